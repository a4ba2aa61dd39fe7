"""Harbor task directories made here, for the `harbor` task's tests: small tasks that run on the Debian test image
(bash, coreutils, python3), written as a Harbor task author writes them, Harbor's fixed paths (/tests,
/logs/verifier, /solution) and all.

- `hello-txt`: scores by reward.txt; its test reads /tests/expected.txt; the oracle writes the answer.
- `calc-json`: scores by reward.json (`reward`, and the metric `style` beside it); the test imports the agent's
  /app/calc.py.
- `hello-pytest`: `hello-txt`, its test run by pytest as Terminal-Bench's are (`python3 -m pytest
  /tests/test_outputs.py`).
- `broken-oracle`: `hello-txt` whose solve.sh writes the wrong answer: the oracle check must flag it.
"""

from __future__ import annotations

from pathlib import Path

# In the tests only: an agent that finds it in what it reads has read the tests.
SECRET = "harbor-secret-7f3a9c"

TASK_TOML = """\
version = "1.0"

[metadata]
author_name = "prorl tests"
difficulty = "easy"

[verifier]
timeout_sec = 120.0

[verifier.env]
GREETING_FILE = "/app/hello.txt"

[agent]
timeout_sec = 300.0

[environment]
build_timeout_sec = 600.0
cpus = 1
memory_mb = 1024
storage_mb = 512
"""
DOCKERFILE = "FROM debian:bookworm-slim\nRUN apt-get update && apt-get install -y python3\n"

HELLO_TEST = f"""\
#!/bin/bash
# {SECRET}
expected=$(cat /tests/expected.txt)
if [ "$(cat "$GREETING_FILE" 2>/dev/null)" = "$expected" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
CALC_TEST = f"""\
#!/bin/bash
# {SECRET}
python3 /tests/grade.py
"""
CALC_GRADE = """\
import json
import sys

sys.path.insert(0, "/app")
cases = [((1, 2), 3), ((2, 3), 5), ((-1, 1), 0), ((10, 5), 15)]
try:
    import calc

    passed = sum(calc.add(*args) == want for args, want in cases)
    style = 0.2 if (calc.__doc__ or "").strip() else 0.0
except Exception as exc:
    print("no calc:", exc)
    passed, style = 0, 0.0
with open("/logs/verifier/reward.json", "w") as out:
    json.dump({"reward": passed / len(cases), "style": style}, out)
"""
PYTEST_TEST = f"""\
#!/bin/bash
# {SECRET}
if python3 -m pytest -q /tests/test_outputs.py; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""
PYTEST_OUTPUTS = """\
def test_the_greeting_is_there():
    with open("/app/hello.txt") as greeting:
        assert greeting.read().strip() == "hello"
"""
CALC_SOLUTION = """\
#!/bin/bash
cat > /app/calc.py <<'EOF'
\"\"\"Arithmetic.\"\"\"


def add(a, b):
    return a + b
EOF
"""


def write_task(
    root: Path,
    name: str,
    instruction: str,
    tests: dict[str, str],
    solution: dict[str, str] | None = None,
    task_toml: str = TASK_TOML,
) -> Path:
    """A Harbor task directory `root`/`name`."""
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (task / "task.toml").write_text(task_toml)
    (task / "instruction.md").write_text(instruction)
    for path, content in tests.items():
        (task / "tests" / path).parent.mkdir(parents=True, exist_ok=True)
        (task / "tests" / path).write_text(content)
    (task / "tests" / "test.sh").chmod(0o755)
    for path, content in (solution or {}).items():
        (task / "solution" / path).parent.mkdir(parents=True, exist_ok=True)
        (task / "solution" / path).write_text(content)
    return task


def hello_task(root: Path, name: str = "hello-txt", prompt_suffix: str = "", solve: str = "hello") -> Path:
    return write_task(
        root,
        name,
        f"Write the word hello into /app/hello.txt. {prompt_suffix}\n",
        {"test.sh": HELLO_TEST, "expected.txt": "hello\n"},
        {"solve.sh": f"#!/bin/bash\necho {solve} > /app/hello.txt\n"},
    )


def pytest_task(root: Path, name: str = "hello-pytest", prompt_suffix: str = "") -> Path:
    return write_task(
        root,
        name,
        f"Write the word hello into /app/hello.txt. {prompt_suffix}\n",
        {"test.sh": PYTEST_TEST, "test_outputs.py": PYTEST_OUTPUTS},
        {"solve.sh": "#!/bin/bash\necho hello > /app/hello.txt\n"},
    )


def calc_task(root: Path, name: str = "calc-json", prompt_suffix: str = "") -> Path:
    return write_task(
        root,
        name,
        f"Write /app/calc.py with a function add(a, b) that returns their sum, and a docstring. {prompt_suffix}\n",
        {"test.sh": CALC_TEST, "grade.py": CALC_GRADE},
        {"solve.sh": CALC_SOLUTION},
    )


def dataset(root: Path) -> Path:
    """The three tasks: two sound ones and one whose oracle fails."""
    root.mkdir(parents=True, exist_ok=True)
    hello_task(root)
    calc_task(root)
    hello_task(root, "broken-oracle", solve="bye")
    return root
