#!/usr/bin/env bash
# The offline top-k pipeline end to end on one device, no network: a random-weight Qwen2-style
# teacher built from a config, a store extracted by one process and again as 2 shards run one
# after the other, both checked bit for bit against each other and with topk-verify, then an
# export -> import round trip. Writes $OUT/topk_pipeline.md (and prints it).
#   OUT=gpu-results bash benchmarks/gpu_topk_pipeline.sh            # cuda (about a minute on an H100)
#   OUT=/tmp/x bash benchmarks/gpu_topk_pipeline.sh --device cpu --small
set -euo pipefail
DEVICE=cuda
SIZE=full
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2; shift 2 ;;
        --small) SIZE=small; shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
now() { date +%s.%N; }

# 1. teacher and corpus
$PY - "$WORK" "$SIZE" <<'PYEOF'
import json, sys, torch, transformers
work, size = sys.argv[1], sys.argv[2]
big = size == "full"
cfg = transformers.Qwen2Config(vocab_size=32768 if big else 1024, hidden_size=512 if big else 64,
                               intermediate_size=1408 if big else 128, num_hidden_layers=4 if big else 2,
                               num_attention_heads=8 if big else 4, num_key_value_heads=2,
                               max_position_embeddings=1024, tie_word_embeddings=False)
torch.manual_seed(0)
model = transformers.Qwen2ForCausalLM(cfg)
with torch.no_grad():  # spread the logits as a trained model's are (a fresh init is near-uniform)
    model.lm_head.weight.mul_(40.0)
model.save_pretrained(f"{work}/teacher")
g = torch.Generator().manual_seed(1)
n, lo, hi = (384, 32, 768) if big else (40, 2, 48)
with open(f"{work}/corpus.jsonl", "w") as f:
    for _ in range(n):
        L = int(torch.randint(lo, hi, (1,), generator=g))
        f.write(json.dumps({"input_ids": torch.randint(0, cfg.vocab_size, (L,), generator=g).tolist()}) + "\n")
print(f"teacher: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, V = {cfg.vocab_size}; "
      f"corpus: {n} sequences")
PYEOF

ARGS=(--model "$WORK/teacher" --data "$WORK/corpus.jsonl" --k 64 --sequences-per-shard 24 --device "$DEVICE"
      --no-progress)
extract() { $PY -m nitrobrew.cli topk-extract "${ARGS[@]}" "$@" > "$WORK/log_$RANDOM.txt"; }

# 2. one process, then 2 shards one after the other
t0=$(now); extract --out "$WORK/single"; t1=$(now)
extract --out "$WORK/sharded" --num-shards 2 --shard-index 1; t2=$(now)
extract --out "$WORK/sharded" --num-shards 2 --shard-index 0; t3=$(now)
# 3. verify, export, import
$PY -m nitrobrew.cli topk-verify "$WORK/sharded" --quiet > "$WORK/verify.txt"
t4=$(now); $PY -m nitrobrew.cli topk-export "$WORK/sharded" "$WORK/parquet" > /dev/null; t5=$(now)
$PY -m nitrobrew.cli topk-import "$WORK/parquet" "$WORK/imported" > /dev/null; t6=$(now)

COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)
$PY - "$WORK" "$OUT/topk_pipeline.md" "$DEVICE" "$COMMIT" "$t0" "$t1" "$t2" "$t3" "$t4" "$t5" "$t6" <<'PYEOF'
import json, os, sys, torch
work, md, device, commit = sys.argv[1:5]
t = [float(x) for x in sys.argv[5:]]

def files(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d)) if not f.startswith(".")}

single, sharded, imported = files(f"{work}/single"), files(f"{work}/sharded"), files(f"{work}/imported")
man = json.loads(single["manifest.json"])
same = single == sharded
diff = sorted(f for f in set(single) | set(sharded) if single.get(f) != sharded.get(f))
round_trip = imported == sharded
size = sum(s["bytes"] for s in man["shards"])
pq = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(f"{work}/parquet") for f in fs)
tokens = man["num_tokens"]
dev = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device
rows = [
    ("device", dev), ("torch", torch.__version__), ("nitrobrew commit", commit),
    ("store", f"{man['num_sequences']} sequences, {tokens} tokens, {man['num_rows']} rows, K = {man['k']}, "
              f"V = {man['vocab_size']}, {len(man['shards'])} shards, {man['logprob_dtype']}"),
    ("single process", f"{t[1] - t[0]:.1f} s (whole command: model load included)"),
    ("2 shards, one after the other", f"{t[2] - t[1]:.1f} s + {t[3] - t[2]:.1f} s"),
    ("2 shards == single process, bit for bit", "yes" if same else f"NO: {diff[:6]}"),
    ("topk-verify", open(f"{work}/verify.txt").read().strip().splitlines()[-1]),
    ("store bytes / position", f"{size / man['num_rows']:.1f} ({size} bytes)"),
    ("parquet export", f"{t[5] - t[4]:.1f} s, {pq} bytes ({pq / man['num_rows']:.1f} / position)"),
    ("export -> import == store, bit for bit", "yes" if round_trip else "NO"),
    ("import", f"{t[6] - t[5]:.1f} s"),
]
text = "# Top-k pipeline check\n\n| what | result |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)
open(md, "w").write(text)
print(text)
sys.exit(0 if same and round_trip else 1)
PYEOF
