"""The rollout viewer in a real browser: `prorl-rollout view DIR` (a process of its own, with a token) over records
whose trajectory holds HTML and script as its text, loaded by headless Chromium (Debian's `chromium`, driven by its
own --dump-dom after the page's script ran: prorl_adapter/dev/browser.py). The pages load, the jobs list shows the
job, the trajectory page shows its token pieces shaded by mask and logprob, and the hostile text renders as text:
no element of it, no script run (the title is not 'pwned')."""

from __future__ import annotations

import asyncio
import html
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from prorl_adapter.dev.browser import chromium, dump_dom, records_viewer
from prorl_adapter.models import JobError, JobState, StageTimings, ToolCall, Trajectory, Turn
from prorl_adapter.service.records import Records

REPO = Path(__file__).resolve().parent.parent
TINY_TOKENIZER = REPO / "models" / "tiny-qwen2"  # make llm: with it the token view shows text, else ids
HOSTILE = """<img src=x onerror="document.title='pwned'"><script>document.title='pwned'</script>"""
TOKEN = "viewer-test-token"


@pytest.fixture(scope="module", autouse=True)
def needs_chromium() -> None:
    if chromium() is None:
        reason = "chromium is not installed (apt-get install chromium; make system-packages does)"
        if os.environ.get("PRORL_REQUIRE_BACKENDS"):
            pytest.fail(f"PRORL_REQUIRE_BACKENDS is set but {reason}", pytrace=False)
        pytest.skip(reason)


def hostile_trajectory(job_id: str, encode) -> Trajectory:
    """A trajectory whose every text an agent or a tool controls is HTML and script."""
    prompt = encode("<|im_start|>user\n" + HOSTILE + "<|im_end|>\n<|im_start|>assistant\n")
    said = encode(HOSTILE)
    tool = encode("<|im_end|>\n<|im_start|>user\n" + HOSTILE + "<|im_end|>\n<|im_start|>assistant\n")
    answer = encode("done")
    response = said + tool + answer
    mask = [1] * len(said) + [0] * len(tool) + [1] * len(answer)
    logprobs = [-0.01 * (i % 7) if m else 0.0 for i, m in enumerate(mask)]
    logprobs[0] = -3.0  # one unlikely token: a shade of its own
    turns = [
        Turn(
            index=0,
            policy_version=2,
            llm_server="http://llm",
            response_start=0,
            response_tokens=len(said),
            finish_reason="stop",
            text=HOSTILE,
            tool_calls=[ToolCall(name="bash", arguments={"command": HOSTILE})],
            tool_call_errors=[HOSTILE],
            observation=HOSTILE,
        ),
        Turn(
            index=1,
            policy_version=3,
            llm_server="http://llm",
            response_start=len(said) + len(tool),
            response_tokens=len(answer),
            finish_reason="stop",
            text="done",
        ),
    ]
    return Trajectory(
        job_id=job_id,
        task="shell",
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=logprobs,
        turns=turns,
        num_turns=2,
        finish_reason="error",
        reward=0.25,
        reward_components={"outcome": 0.25},
        policy_version_min=2,
        policy_version_max=3,
        timings=StageTimings(queued_s=0.1, init_s=0.5, run_s=2.0, eval_s=0.3),
        error=JobError(error_class="eval", message=HOSTILE),
        labels={"note": HOSTILE},
        artifacts={"git_patch": HOSTILE},
    )


@pytest.fixture(scope="module")
def viewer_url(tmp_path_factory) -> Iterator[str]:
    """`prorl-rollout view` over a records directory with the hostile trajectory, with a token; its page's URL."""
    directory = tmp_path_factory.mktemp("records")
    tokenizer = []
    if TINY_TOKENIZER.is_dir():
        from prorl_adapter.service.chat import ChatTokenizer

        encode = ChatTokenizer(str(TINY_TOKENIZER)).encode
        tokenizer = ["--tokenizer", str(TINY_TOKENIZER)]
    else:
        encode = lambda text: [ord(c) % 1000 for c in text]  # noqa: E731 - ids only: the view shows them as ids
    records = Records(directory, "browser-test")
    records.prorl_job_finished(hostile_trajectory("hostile-job", encode), JobState.failed)
    records.close()
    with records_viewer(directory, "--token", TOKEN, *tokenizer) as url:
        yield url


def test_the_jobs_list_loads_with_the_token_from_the_fragment_and_shows_the_job(viewer_url):
    dom = dump_dom(f"{viewer_url}#token={TOKEN}")
    assert 'data-loaded="true"' in dom, dom[-3000:]
    assert 'data-job="hostile-job"' in dom and 'class="state-failed"' in dom
    assert "records of " in dom and "0.250" in dom  # the source and the reward
    assert html.escape(HOSTILE, quote=False) in dom  # the label, as text
    assert "<img" not in dom and dom.count("<script") == 1 and "pwned" not in dom.split("</title>")[0]


def test_without_the_token_the_page_loads_and_asks_for_it(viewer_url):
    dom = dump_dom(viewer_url)
    assert 'data-loaded="error"' in dom and "needs its API token" in dom
    assert 'data-job="hostile-job"' not in dom


def test_the_trajectory_page_shows_the_hostile_text_as_text_and_the_tokens_shaded(viewer_url):
    dom = dump_dom(f"{viewer_url}#token={TOKEN}&job=hostile-job&tab=tokens")
    assert 'data-loaded="true"' in dom, dom[-3000:]
    title = dom.split("<title>", 1)[1].split("</title>", 1)[0]
    assert title == "prorl rollout viewer"  # no injected script ran
    assert "<img" not in dom and dom.count("<script") == 1  # the viewer's own script tag, nothing injected
    escaped = html.escape(HOSTILE, quote=False)
    # the turn's text, its tool call's argument, its unparsed call, the tool output, the error and the artifact
    assert dom.count(escaped) >= 5, dom[-5000:]
    assert '<pre class="text">' + escaped + "</pre>" in dom
    assert '<pre class="observation">' + escaped + "</pre>" in dom
    # the token view: one span per token, by mask and logprob bucket, with the policy version of each sampled one
    assert 'class="tok mask-1 lp-5 ver-2 turn-start"' in dom  # the unlikely first token (-3.0: p 0.05)
    assert 'class="tok mask-1 lp-0 ver-2"' in dom and 'class="tok mask-0"' in dom
    assert 'data-mask="1"' in dom and 'data-mask="0"' in dom and 'data-version="3"' in dom
    assert 'data-logprob="-3"' in dom and 'data-part="prompt"' in dom
    assert "version-start" in dom  # where version 3's turn begins
    if TINY_TOKENIZER.is_dir():  # the pieces are text, the hostile ones too
        tokens = dom.split('id="sequences"', 1)[1]
        assert HOSTILE in html.unescape(re.sub(r"<[^>]*>", "", tokens))  # the pieces' text, concatenated


async def test_the_live_service_serves_the_page_its_counters_jobs_and_tokens():
    """The service itself (its stand-ins for the LLM server, the runtime and the tokenizer, on loopback ports)."""
    from tests.fakes import bash_call, finish_call, rollout_stack, shell_job

    async with rollout_stack(script=[bash_call("echo '<b>hi</b>'"), finish_call("42")], token=TOKEN) as stack:
        done = await stack.client.run(shell_job(labels={"split": "train"}), wait=60)
        await stack.client.set_policy_version(2)
        listed = await asyncio.to_thread(dump_dom, f"{stack.url}/viewer#token={TOKEN}")
        job = await asyncio.to_thread(dump_dom, f"{stack.url}/viewer#token={TOKEN}&job={done.job_id}&tab=tokens")
    assert 'data-loaded="true"' in listed, listed[-3000:]
    assert f'data-job="{done.job_id}"' in listed and 'class="state-done"' in listed
    for counter in ("policy version", "LLM servers", "runtimes", "admission", "buffer", "episodes/s (60 s)"):
        assert f'<span class="name">{counter}</span>' in listed, counter
    assert '<span class="name">LLM servers</span><b>1/1</b>' in listed and "live: replica unit-tests" in listed
    assert 'data-loaded="true"' in job, job[-3000:]
    assert "echo '&lt;b&gt;hi&lt;/b&gt;'" in job and "<b>hi</b>" not in job  # the tool call, as text
    assert 'data-mask="1"' in job and 'data-mask="0"' in job and 'data-version="0"' in job


async def test_a_tripped_circuit_breaker_says_why_on_the_page():
    """The breaker's reason, on the counters of the live page (issue 43: the viewer says why admission paused)."""
    from prorl_adapter.service.server import PIPELINE
    from tests.fakes import bash_call, finish_call, rollout_stack, shell_job

    breaker = {"threshold": 0.04, "min_episodes": 1}  # 1 of 2 episodes trips it
    async with rollout_stack(script=[bash_call("ls"), finish_call("1")], token=TOKEN, breaker=breaker) as stack:
        done = await stack.client.run(shell_job(), wait=60)
        tampered = done.model_copy(update={"artifacts": {"tampered": "a canary read as passed"}})
        stack.app[PIPELINE].plugins.notify("prorl_job_finished", trajectory=tampered, state=JobState.done)
        assert (await stack.client.status()).breaker.tripped
        listed = await asyncio.to_thread(dump_dom, f"{stack.url}/viewer#token={TOKEN}")
    assert 'data-loaded="true"' in listed, listed[-3000:]
    shown = html.unescape(listed.split('<span class="name">circuit breaker</span>', 1)[1].split("</b>", 1)[0])
    assert "policy version 0" in shown and "tampered 1" in shown and "/v1/breaker/reset" in shown
