"""Shared loaders for the tokenizer audit (ours from GGUF, ours from the cached checkpoint, HF from GGUF)."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

def gguf_path():
    from models import pretrained as pre
    return pre.cache_dir() / "gguf" / pre.known_model("smollm2").gguf_filename

def ours_from_gguf():
    import gguf

    from models.tokenizer import Tokenizer
    return Tokenizer.from_gguf(gguf.GGUFReader(str(gguf_path())))

def ours_from_ckpt():
    from models import pretrained as pre
    from models.tokenizer import Tokenizer
    return Tokenizer.load(pre.cache_dir() / "models" / "smollm2-135m-instruct")

def hf_tok():
    import transformers
    p = gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
