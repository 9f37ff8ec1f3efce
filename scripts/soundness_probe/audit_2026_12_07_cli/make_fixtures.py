"""Bad model inputs for the CLI audit, all under /tmp/cli_audit (run with /work/main/.venv/bin/python from /work/main).

From the real SmolLM2 GGUF: truncated / header-only / empty / random / NaN-scaled copies. Tiny models built with the
library's own writers (tests/test_loaders.py helpers, read only): an HF dir (+ truncated safetensors, + config that
does not match the tensors, + NaN weights), and a certattn checkpoint (+ flipped data byte, + edited config,
+ removed params dir)."""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, "/work/main")
sys.path.insert(0, "/work/main/tests")
from test_loaders import CFG_TIED, random_params, tiny_tokenizer, write_hf_dir  # noqa: E402

from models.checkpoint import save_checkpoint  # noqa: E402
from models.pretrained import cache_dir  # noqa: E402

T = Path("/tmp/cli_audit")
if T.exists():
    shutil.rmtree(T)
T.mkdir()
src = cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
data = src.read_bytes()
(T / "trunc_half.gguf").write_bytes(data[: len(data) // 2])
(T / "trunc_end.gguf").write_bytes(data[:-1000])
(T / "header_only.gguf").write_bytes(data[:4096])
(T / "empty.gguf").write_bytes(b"")
(T / "random.gguf").write_bytes(np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
(T / "not_a_model.bin").write_bytes(b"hello")
# NaN scales: 0xFF bytes over 64 KiB in the middle of the tensor data (Q4_1 fp16 scale 0xFFFF = NaN)
bad = bytearray(data)
mid = len(bad) // 2
bad[mid: mid + 65536] = b"\xff" * 65536
(T / "nan_blocks.gguf").write_bytes(bytes(bad))
# finite garbage (fp16 scales of 0x3c00.. = 1.0 and random nibbles): undetectable without a checksum
bad = bytearray(data)
bad[mid: mid + 65536] = np.random.default_rng(1).integers(0, 0x3b, 65536, dtype=np.uint8).tobytes()
(T / "garbage_blocks.gguf").write_bytes(bytes(bad))
del data, bad

(T / "empty_dir").mkdir()
(T / "rand_dir").mkdir()
(T / "rand_dir" / "foo.txt").write_text("x")

params = random_params(CFG_TIED)
hf = write_hf_dir(T / "hf_tiny", params, CFG_TIED)
hf_trunc = shutil.copytree(hf, T / "hf_trunc")
st = hf_trunc / "model.safetensors"
st.write_bytes(st.read_bytes()[:-5000])
hf_mis = shutil.copytree(hf, T / "hf_mismatch")
cfg = json.loads((hf_mis / "config.json").read_text())
cfg["hidden_size"] = 96
(hf_mis / "config.json").write_text(json.dumps(cfg))
nanp = random_params(CFG_TIED)
nanp["layers"][0]["wq"][0, 0] = np.nan
write_hf_dir(T / "hf_nan", nanp, CFG_TIED)
hf_badjson = shutil.copytree(hf, T / "hf_badjson")
(hf_badjson / "config.json").write_text("{not json")

ck = save_checkpoint(T / "ckpt_tiny", params, CFG_TIED, tiny_tokenizer(), source="audit")
flip = shutil.copytree(ck, T / "ckpt_flip")
files = sorted((p for p in (flip / "params").rglob("*") if p.is_file() and "/d/" in str(p)), key=lambda p: -p.stat().st_size)
big = files[0]
b = bytearray(big.read_bytes())
b[len(b) // 2] ^= 0x40
big.write_bytes(bytes(b))
print("flipped a byte in", big, file=sys.stderr)
trunc = shutil.copytree(ck, T / "ckpt_trunc")
big = sorted((p for p in (trunc / "params").rglob("*") if p.is_file() and "/d/" in str(p)), key=lambda p: -p.stat().st_size)[0]
big.write_bytes(big.read_bytes()[: big.stat().st_size // 2])
mis = shutil.copytree(ck, T / "ckpt_mismatch")
cfg = json.loads((mis / "config.json").read_text())
cfg["intermediate_size"] = 64
(mis / "config.json").write_text(json.dumps(cfg))
nop = shutil.copytree(ck, T / "ckpt_noparams")
shutil.rmtree(nop / "params")
nan_ck = save_checkpoint(T / "ckpt_nan", nanp, CFG_TIED, tiny_tokenizer(), source="audit-nan")
print("fixtures in", T, sorted(os.listdir(T)))
