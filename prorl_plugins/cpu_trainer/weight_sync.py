"""Pushing the trainer's weights to the vLLM servers, and proving they arrived.

vLLM started with `VLLM_SERVER_DEV_MODE=1` (scripts/serve-vllm.sh does) reloads weights in place from a
directory: `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`, then
`POST /reset_prefix_cache` so no cached prefix keeps old activations. After each push the server scores a probe
sequence (`prompt_logprobs`) and the scores must match the trainer's own: a push that silently did nothing
(the tied-embeddings trap, a wrong directory, a server without dev mode) fails the run instead of leaving the
reward flat.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from server_kit.errors import ProrlError


class WeightSyncError(ProrlError, RuntimeError):
    pass


class VllmWeightSync:
    def __init__(self, urls: list[str], model: str = "tiny", tolerance: float = 1e-3, timeout: float = 120.0):
        self.urls = [url.rstrip("/") for url in urls]
        self.model = model
        self.tolerance = tolerance
        self._http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _post(self, url: str, path: str, body: dict | None = None) -> httpx.Response:
        try:
            response = self._http.post(url + path, json=body)
        except httpx.TransportError as exc:
            raise WeightSyncError(f"vLLM server {url} is unreachable: {exc}") from exc
        if response.status_code == 404:
            raise WeightSyncError(
                f"{url}{path} is not served: start vLLM with VLLM_SERVER_DEV_MODE=1 (scripts/serve-vllm.sh does)"
            )
        if response.status_code >= 400:
            raise WeightSyncError(f"{url}{path} answered {response.status_code}: {response.text[:500]}")
        return response

    def push(self, weights_dir: Path) -> None:
        for url in self.urls:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}}
            self._post(url, "/collective_rpc", body)
            self._post(url, "/reset_prefix_cache")

    def server_logprobs(self, url: str, token_ids: list[int]) -> list[float]:
        """The server's logprobs of tokens 1..n of `token_ids`, as it scores a prompt."""
        body = {"model": self.model, "prompt": token_ids, "max_tokens": 1, "prompt_logprobs": 0}
        scored = self._post(url, "/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
        return [entry[str(token)]["logprob"] for entry, token in zip(scored[1:], token_ids[1:])]

    def verify(self, token_ids: list[int], trainer_logprobs: list[float]) -> float:
        """The largest |server - trainer| logprob over the probe on every server; raises above tolerance."""
        worst = 0.0
        for url in self.urls:
            gap = max(abs(a - b) for a, b in zip(self.server_logprobs(url, token_ids), trainer_logprobs))
            if gap > self.tolerance:
                raise WeightSyncError(
                    f"the weights did not reach {url}: its logprobs differ from the trainer's by {gap:.3g} "
                    f"(tolerance {self.tolerance:g}) after the reload"
                )
            worst = max(worst, gap)
        return worst
