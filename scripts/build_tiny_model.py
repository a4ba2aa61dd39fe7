#!/usr/bin/env python3
"""Build a tiny random-initialised Qwen2 causal LM, offline and deterministically, for integration tests.

The model (2 layers, hidden 128, head_dim 32) knows nothing: it exists so that a real vLLM server can serve
real token ids and logprobs. Its tokenizer is a byte-level BPE trained here on a small built-in corpus, with
the ChatML special tokens and the hermes tool-call tokens of Qwen2.5, and a Qwen2.5-style chat template that
takes `tools`.

Needs torch (CPU), transformers and tokenizers: run it with the vLLM venv (scripts/vllm-env.sh), e.g.
    .venv-vllm/bin/python scripts/build_tiny_model.py [--out models/tiny-qwen2] [--force]
A complete build leaves a marker file (BUILD_MARKER) holding the build spec; a later run with the same spec
skips the build. The build goes to a temporary folder first and is renamed into place, so a half-built model
is never mistaken for a complete one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "tiny-qwen2"
BUILD_MARKER = ".tiny-model-complete"
SEED = 1234

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special: skipped when decoding
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]  # added, kept as text
VOCAB_SIZE = 3072  # BPE vocab incl. the 3 special tokens; the 4 tool tokens are added after it

MODEL_SPEC = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head_dim 32: the vLLM CPU attention backend needs head_dim >= 32
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    # Untied: with tied embeddings an in-place weight reload in vLLM silently keeps the old output head.
    "tie_word_embeddings": False,
    "dtype": "float32",
}

# Qwen2.5's template (hermes tool calls), with a neutral default system prompt, and tool-call arguments
# accepted either as an object or as an already-encoded JSON string (OpenAI's wire form).
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
    {{- "{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
          or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_BASE_CORPUS = [
    # shell
    "ls -la /tmp",
    "cd /home/user/repo && git status",
    "cat README.md | head -n 20",
    "grep -rn 'def main' src/ --include='*.py'",
    "find . -name '*.py' -type f | xargs wc -l",
    "echo hello world > out.txt && cat out.txt",
    "python -m pytest -x -q tests/",
    "pip install -e '.[test]'",
    "mkdir -p build && cd build && cmake .. && make -j2",
    "export PATH=$HOME/.local/bin:$PATH",
    "sed -i 's/foo/bar/g' config.yaml",
    "tail -f /var/log/syslog",
    "ps aux | grep python | awk '{print $2}'",
    "chmod +x run.sh && ./run.sh --verbose",
    "diff -u old.txt new.txt",
    "curl -s http://127.0.0.1:8000/health",
    "for i in 1 2 3; do echo $i; done",
    "if [ -f setup.py ]; then python setup.py test; fi",
    "rm -rf __pycache__ .pytest_cache",
    "git diff HEAD~1 -- src/main.py",
    "git log --oneline -n 5",
    "wc -c < data.bin",
    "sort names.txt | uniq -c | sort -rn",
    "tar -czf backup.tar.gz src/",
    "python3 -c 'print(1 + 2)'",
    "exit 0",
    "true",
    "pwd",
    # python
    "def add(a, b):\n    return a + b\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "with open('data.json') as f:\n    data = json.load(f)\n",
    "try:\n    value = int(text)\nexcept ValueError:\n    value = None\n",
    "result = [x * x for x in numbers if x > 0]",
    "async def fetch(client, url):\n    response = await client.get(url)\n    return response.json()\n",
    "assert len(items) == 3, f'expected 3 items, got {len(items)}'",
    "from pathlib import Path\n\nfor path in Path('.').glob('**/*.py'):\n    print(path)\n",
    "def test_add():\n    assert add(2, 3) == 5\n",
    "raise RuntimeError('something went wrong')",
    "return {'status': 'ok', 'count': count}",
    "Traceback (most recent call last):\n  File \"main.py\", line 3, in <module>\nNameError: name 'x' is not defined",
    # JSON
    '{"name": "bash", "arguments": {"command": "ls"}}',
    '{"status": "ok", "exit_code": 0, "stdout": "hello\\n", "stderr": ""}',
    '{"id": 42, "tags": ["a", "b", "c"], "nested": {"key": null, "flag": true, "ratio": 0.5}}',
    '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]',
    '{"type": "function", "function": {"name": "bash", "description": "Run a shell command", '
    '"parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}',
    # English
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant.",
    "Please fix the failing test in the repository and explain what was wrong.",
    "The function returns the sum of two numbers, but it fails when the input is empty.",
    "I will list the files in the current directory first.",
    "All tests passed. The bug was an off-by-one error in the loop.",
    "Run the command and report the output.",
    "What is the capital of France? The answer is Paris.",
    "Let me check the contents of the configuration file.",
    "Error: file not found. Please check the path and try again.",
    # digits
    "0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 4096 65536 3.14159 2.71828 -1 -42 1e-6",
    "2024-01-15 12:34:56 port 8080 pid 31337 exit code 127",
    # tool calls, ChatML
    '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>',
    '<tool_call>\n{"name": "bash", "arguments": {"command": "cat main.py"}}\n</tool_call>',
    "<tool_response>\nmain.py\nREADME.md\ntests\n</tool_response>",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nList the files.<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\nREADME.md\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nThere is one file: README.md.<|im_end|>\n<|endoftext|>",
]

_WORDS = """
the a an of to in is it that for on with as was at by this be from or are file test code run error
value list dict string number function class return import print output input path line command shell
directory user system assistant tool call response result fix bug check read write open close start
stop server client request status exit data json python bash git commit branch merge diff patch
install build make config option flag argument name arguments content role message model token
""".split()  # noqa: SIM905
_COMMANDS = """
ls cat grep find echo cd pwd head tail wc sort uniq sed awk git python pip make mkdir rm cp mv touch
""".split()  # noqa: SIM905
_FILES = """
main.py README.md setup.py test_main.py config.yaml data.json notes.txt run.sh Makefile utils.py
""".split()  # noqa: SIM905


def build_corpus(seed: int = SEED) -> list[str]:
    """The built-in corpus, plus seeded variations so that BPE training reaches the target vocab size."""
    rng = random.Random(seed)
    lines = list(_BASE_CORPUS) * 4
    for _ in range(1500):
        kind = rng.randrange(6)
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 15))).capitalize() + ".")
        elif kind == 1:
            command = f"{rng.choice(_COMMANDS)} {rng.choice(_FILES)}"
            lines.append(f'<tool_call>\n{{"name": "bash", "arguments": {{"command": "{command}"}}}}\n</tool_call>')
        elif kind == 2:
            lines.append(f"{rng.choice(_COMMANDS)} -{rng.choice('alnrvfh')} {rng.choice(_FILES)}")
        elif kind == 3:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8)))
        elif kind == 4:
            lines.append(json.dumps({rng.choice(_WORDS): rng.choice(_WORDS), "n": rng.randint(0, 999)}))
        else:
            name = "_".join(rng.choice(_WORDS) for _ in range(2))
            lines.append(f"def {name}(x):\n    return x + {rng.randint(0, 99)}\n")
    return lines


def spec_digest() -> str:
    """A digest of everything that determines the build: a changed spec makes a complete build stale."""
    spec = {
        "seed": SEED,
        "vocab_size": VOCAB_SIZE,
        "special": SPECIAL_TOKENS,
        "tool_tokens": TOOL_TOKENS,
        "model": MODEL_SPEC,
        "template": CHAT_TEMPLATE,
        "corpus": build_corpus(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def is_complete(out: Path) -> bool:
    marker = out / BUILD_MARKER
    return marker.is_file() and marker.read_text().strip() == spec_digest()


def build_tokenizer(out: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    # Like Qwen2.5: the tool tokens are single added tokens, not special, so decoding keeps them as text.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=MODEL_SPEC["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    # Older transformers read the template only from tokenizer_config.json; newer ones write it to
    # chat_template.jinja. Keep it in both places so either loads it.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    return fast


def build_model(out: Path, tokenizer) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    spec = dict(MODEL_SPEC)
    dtype = spec.pop("dtype")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_cache=True,
        **spec,
    )
    config.dtype = dtype
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(str(out), safe_serialization=True)


def check(out: Path) -> None:
    """Load what was written back and exercise the template and the tokenizer: fail loudly, not at serve time."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>", (tok.eos_token, tok.pad_token)
    for t in SPECIAL_TOKENS + TOOL_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, f"{t!r} is not a single token: {ids}"
    call = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    assert tok.decode(tok.encode(call, add_special_tokens=False)) == call
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "List the files."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}],
        },
        {"role": "tool", "content": "README.md"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in text and '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nREADME.md\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head.data_ptr() != embed.data_ptr(), "output head is tied to the embeddings"
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode(text, add_special_tokens=False)])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete build is there")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()

    if is_complete(out) and not args.force:
        print(f"tiny model already built: {out}")
    else:
        try:
            import tokenizers  # noqa: F401
            import torch  # noqa: F401
            import transformers
        except ImportError as exc:
            sys.exit(
                f"{exc}: building the tiny model needs torch, transformers and tokenizers; run it with the vLLM venv"
            )
        transformers.utils.logging.disable_progress_bar()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            tokenizer = build_tokenizer(tmp)
            build_model(tmp, tokenizer)
            check(tmp)
            (tmp / BUILD_MARKER).write_text(spec_digest() + "\n")
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"tiny model built: {out}")

    config = json.loads((out / "config.json").read_text())
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    print(f"vocab {config['vocab_size']}, hidden {config['hidden_size']}, layers {config['num_hidden_layers']}")
    for name, size in sizes.items():
        print(f"  {size:>10}  {name}")
    print(f"  {sum(sizes.values()):>10}  total bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
