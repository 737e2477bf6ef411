"""A vLLM server started by the user (``generation_backend: vllm-server``); the trainer connects by URL.

The server (docs/hf.md, "vLLM backends"):

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model STUDENT_DIR \\
        --host 127.0.0.1 --port 8000 --skip-tokenizer-init --logprobs-mode processed_logprobs

``VLLMServerGenerator(model, base_url=...)``:
- ``generate``: one ``/v1/completions`` request per prompt (token-id prompts, ``return_token_ids``, the
  sampled tokens' log-probs), sent together; the server batches them;
- ``sync_weights(model)``, every ``sync_every``-th call: the student's weights as a safetensors file in
  ``weights_dir`` (a directory the server can read: the same machine or a shared file system), loaded by the
  server's own ``reload_weights`` (``POST /collective_rpc``, dev mode), then ``POST /reset_prefix_cache``.
  On CUDA, ``weight_transfer="nccl"`` broadcasts the weights over vLLM's NCCL weight-transfer engine instead
  (the server started with ``--weight-transfer-config '{"backend": "nccl"}'``);
- a server that is gone (refused, reset, closed) or silent past the timeout raises
  ``GenerationServerError`` (a ``ConnectionError``), one line naming the URL: never a hang.

Only the standard library talks HTTP here; vLLM itself is needed on this side for NCCL alone.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from .base import Completions, Sampling
from .vllm_engine import _check_sync_every, completions_from, prompt_lists, sampling_fields, write_weights


class GenerationServerError(ConnectionError):
    """The generation server cannot be reached or did not answer in time."""


class VLLMServerGenerator:
    """Generation by a running vLLM server (see the module docstring).

    Args:
        model: the student (its weights are pushed to the server by ``sync_weights``).
        base_url: the server's address, e.g. ``http://127.0.0.1:8000``.
        sync_every: push the student's weights on every ``sync_every``-th ``sync_weights`` call.
        request_timeout: seconds a generation or weight-load request may take before it is an error.
        connect_timeout: seconds the health check before each call may take.
        weights_dir: where the weights file is written for the server to read (default: a temporary
            directory on this machine).
        weight_transfer: ``"file"`` (the default) or ``"nccl"`` (CUDA only).
        nccl_host: this machine's address as the server sees it (the NCCL rendezvous).
    """

    name = "vllm-server"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        base_url: str,
        sync_every: int = 1,
        request_timeout: float = 600.0,
        connect_timeout: float = 10.0,
        weights_dir: Optional[str] = None,
        weight_transfer: str = "file",
        nccl_host: str = "127.0.0.1",
    ):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_url must be an http:// or https:// URL, got {base_url!r}")
        for key, value in (("request_timeout", request_timeout), ("connect_timeout", connect_timeout)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{key} must be a number of seconds > 0, got {value!r}")
        if weight_transfer not in ("file", "nccl"):
            raise ValueError(f"weight_transfer must be 'file' or 'nccl', got {weight_transfer!r}")
        if weight_transfer == "nccl" and not torch.cuda.is_available():
            raise ValueError("weight_transfer 'nccl' needs CUDA (NCCL); use 'file'")
        self.model = model
        self.base_url = base_url.rstrip("/")
        self.sync_every = _check_sync_every(sync_every)
        self.request_timeout = float(request_timeout)
        self.connect_timeout = float(connect_timeout)
        self.weight_transfer = weight_transfer
        self.nccl_host = nccl_host
        if weights_dir is None:
            weights_dir = tempfile.mkdtemp(prefix="nitrobrew-vllm-weights-")
            weakref.finalize(self, shutil.rmtree, weights_dir, True)
        self.weights_dir = weights_dir
        self.weight_version = 0
        self.sync_calls = 0
        self._nccl = None
        self.served_model = self._served_model()

    # -- HTTP ------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body=None, timeout: Optional[float] = None):
        url = f"{self.base_url}{path}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        timeout = self.request_timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            detail = " ".join(err.read().decode(errors="replace").split())[:300]
            hint = " (start the server with VLLM_SERVER_DEV_MODE=1)" if err.code == 404 else ""
            raise GenerationServerError(
                f"vLLM server at {self.base_url}: {method} {path} answered HTTP {err.code}{hint}: {detail}"
            ) from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, OSError) as err:
            reason = getattr(err, "reason", err)
            what = "did not answer within" if isinstance(reason, (socket.timeout, TimeoutError)) else "is unreachable"
            limit = f" {timeout:g} s" if what == "did not answer within" else ""
            raise GenerationServerError(
                f"vLLM server at {self.base_url} {what}{limit} ({method} {path}: "
                f"{type(reason).__name__}: {' '.join(str(reason).split()) or 'connection closed'})"
            ) from None
        return json.loads(raw) if raw else None

    def _served_model(self) -> str:
        listing = self._request("GET", "/v1/models", timeout=self.connect_timeout)
        try:
            return listing["data"][0]["id"]
        except (TypeError, KeyError, IndexError):
            raise GenerationServerError(
                f"vLLM server at {self.base_url}: /v1/models lists no model ({listing!r})"
            ) from None

    def _complete(self, prompt, fields):
        # Token ids in, token ids out: the server needs no tokenizer (--skip-tokenizer-init).
        body = dict(
            model=self.served_model, prompt=prompt, return_token_ids=True, return_tokens_as_token_ids=True, **fields
        )
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        tokens = choice.get("token_ids")
        if tokens is None:
            raise GenerationServerError(
                f"vLLM server at {self.base_url} returned no token_ids: it needs return_token_ids (vLLM >= 0.10.2)"
            )
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        return list(tokens), (None if lps is None or len(lps) != len(tokens) else lps)

    # -- the Generator protocol -----------------------------------------------------------------
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling) -> Completions:
        self._request("GET", "/health", timeout=self.connect_timeout)  # a dead server fails here, at once
        prompts = prompt_lists(prompt_ids, prompt_mask)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=max(1, min(len(prompts), 64))) as pool:
            rows = list(pool.map(self._complete, prompts, [sampling_fields(sampling, b) for b in range(len(prompts))]))
        seconds = time.perf_counter() - t0
        return completions_from(
            rows, sampling, device=prompt_ids.device, weight_version=self.weight_version, seconds=seconds
        )

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.sync_calls += 1
        self.model = model
        if self.sync_calls % self.sync_every:
            return
        if self.weight_transfer == "nccl":
            self._send_nccl(model)
        else:
            write_weights(model, self.weights_dir)
            self._request(
                "POST",
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": os.path.abspath(self.weights_dir)}},
            )
        self._request("POST", "/reset_prefix_cache")
        self.weight_version = self.sync_calls

    def sleep(self) -> None:
        """The server keeps its own memory (it runs on its own devices): nothing to free here."""

    def wake(self) -> None:
        pass

    # -- NCCL (CUDA only; not exercised by the CPU tests) ----------------------------------------
    def _send_nccl(self, model: torch.nn.Module) -> None:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        from ..model import unwrap

        source = ModuleSource(unwrap(model))  # transformers' parameter names: the checkpoint's
        if self._nccl is None:
            workers = int(self._request("GET", "/get_world_size", timeout=self.connect_timeout)["world_size"])
            host = self.nccl_host
            with socket.socket() as s:  # a free port for the rendezvous
                s.bind((host, 0))
                port = s.getsockname()[1]
            info = NCCLTrainerInitInfo(master_address=host, master_port=port, world_size=workers + 1, rank=0)
            client = HTTPVLLMWeightSyncClient(self.base_url, timeout=self.request_timeout)
            self._nccl = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
        self._nccl.source = source
        try:
            self._nccl.send_weights()
        except (OSError, RuntimeError) as err:
            raise GenerationServerError(
                f"vLLM server at {self.base_url}: NCCL weight transfer failed ({type(err).__name__}: "
                f"{' '.join(str(err).split())})"
            ) from None
