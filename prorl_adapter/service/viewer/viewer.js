// The rollout viewer (docs/viewer.md): plain JavaScript, no framework, nothing fetched from elsewhere.
//
// Rule of this file: text that comes from the API (trajectory text, tool output, task names, labels, errors) reaches
// the DOM only as text nodes (`el`, `textContent`), never as markup: a trajectory whose text is HTML or a script is
// shown as that text. The page's Content-Security-Policy forbids inline scripts besides.
//
// The API token: from the URL's fragment (`#token=...`, which a browser never sends to the server), then removed
// from the address bar and kept in sessionStorage (this tab only); or typed into the token box.
"use strict";

(() => {
  const TOKEN_KEY = "prorl-viewer-token";
  const REFRESH_MS = 5000;
  const $ = (id) => document.getElementById(id);
  let refreshTimer = null;
  let lastJobs = [];

  // -- DOM, as text only ------------------------------------------------------------------------------------
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined) continue;
      if (key === "className") node.className = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else if (key === "title") node.title = String(value);
      else if (key === "href") node.setAttribute("href", value);
      else if (key === "open") node.open = Boolean(value);
      else throw new Error("el: unexpected property " + key);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function clear(node) {
    while (node.firstChild) node.removeChild(node.firstChild);
    return node;
  }

  function say(text, isError) {
    const box = $("message");
    box.textContent = text || "";
    box.hidden = !text;
    box.className = isError ? "error" : "";
  }

  const fixed = (value, digits) => (value === null || value === undefined ? "" : Number(value).toFixed(digits));
  const when = (seconds) => (seconds ? new Date(seconds * 1000).toISOString().replace("T", " ").slice(0, 19) : "");

  function keyValues(object, digits) {
    return Object.entries(object || {}).map(([k, v]) =>
      el("span", { className: "kv" }, el("span", { className: "k" }, k + "="), digits === undefined ? v : fixed(v, digits)),
    );
  }

  // -- the token and the API ----------------------------------------------------------------------------------
  function fragment() {
    return new URLSearchParams(location.hash.replace(/^#/, ""));
  }

  function takeTokenFromFragment() {
    const params = fragment();
    if (!params.has("token")) return;
    sessionStorage.setItem(TOKEN_KEY, params.get("token"));
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
  }

  async function api(path) {
    const token = sessionStorage.getItem(TOKEN_KEY);
    const headers = token ? { Authorization: "Bearer " + token } : {};
    let response;
    try {
      response = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
    } catch (error) {
      throw new Error("the service cannot be reached: " + error.message);
    }
    let body = null;
    try {
      body = await response.json();
    } catch (error) {
      body = null;
    }
    if (response.status === 401) {
      $("token-input").focus();
      throw new Error("the service needs its API token: type it in the token box (or open the page as /viewer#token=...)");
    }
    return { status: response.status, body };
  }

  function failure(reply) {
    const why = reply.body && reply.body.error ? reply.body.error : "HTTP " + reply.status;
    return new Error(why);
  }

  // -- live counters ------------------------------------------------------------------------------------------
  function counter(name, value, title, degraded) {
    return el("span", { className: degraded ? "counter degraded" : "counter", title },
      el("span", { className: "name" }, name), el("b", null, value));
  }

  const sum = (object) => Object.values(object || {}).reduce((a, b) => a + (b || 0), 0);

  async function loadCounters() {
    const box = $("counters");
    const status = await api("v1/status");
    if (status.status !== 200) throw failure(status);
    const s = status.body;
    const items = [];
    if (s.source) {  // `prorl-rollout view DIR`: records, not a live service
      $("source").textContent = s.source;
      items.push(counter("trajectories", s.trajectories), counter("shards", s.shards));
      if (s.open_shards) items.push(counter("open shards (skipped)", s.open_shards, "being written, or left by a killed service"));
      if (s.policy_version !== null) items.push(counter("newest policy version", s.policy_version));
      items.push(counter("tokenizer", s.tokenizer || "none: ids shown"));
    } else {
      $("source").textContent = "live" + (s.replica ? ": replica " + s.replica : "");
      const healthy = (s.llm_servers || []).filter((server) => server.healthy).length;
      const alive = (s.runtimes || []).filter((runtime) => runtime.alive).length;
      const warm = Object.values(s.warm_sandboxes || {});
      const rc = s.run_concurrency;
      items.push(
        counter("policy version", s.policy_version),
        counter("queued", sum(s.queues), "waiting for a stage's worker: " + JSON.stringify(s.queues)),
        counter("active", sum(s.active), JSON.stringify(s.active)),
        counter("done", (s.finished || {}).done), counter("failed", (s.finished || {}).failed),
        counter("cancelled", (s.finished || {}).cancelled),
        counter("episodes/s (60 s)", s.episodes_per_s_last_60s),
        counter("LLM servers", healthy + "/" + (s.llm_servers || []).length, "healthy / all"),
        counter("runtimes", alive + "/" + (s.runtimes || []).length, "alive / all"),
      );
      if (warm.length) {
        const ready = warm.reduce((a, w) => a + w.ready, 0);
        const size = warm.reduce((a, w) => a + w.size, 0);
        const hits = warm.reduce((a, w) => a + w.hits, 0);
        const misses = warm.reduce((a, w) => a + w.misses, 0);
        items.push(counter("warm pool", ready + "/" + size, "ready / size; hits " + hits + ", misses " + misses));
      }
      if (rc) items.push(counter("admission", rc.held + "/" + rc.limit, rc.mode + " run concurrency: held / limit"));
      if (s.degraded) items.push(counter("degraded", s.degraded, null, true));
      const breaker = s.breaker;  // the circuit breaker (--breaker-threshold): why admission paused, when it did
      if (breaker && breaker.tripped) items.push(counter("circuit breaker", breaker.reason, null, true));
      else if (breaker && breaker.enabled) {
        items.push(counter("circuit breaker", "closed", "trips when a version's share of flagged episodes reaches " + breaker.threshold));
      }
      const buffer = await api("v1/buffer");  // decoupled mode's; a server without it answers 404
      if (buffer.status === 200) {
        const b = buffer.body;
        items.push(
          counter("buffer", (b.ready ?? "?") + " ready, " + (b.pending ?? "?") + " leased", "the experience buffer"),
          counter("upcoming", b.upcoming), counter("in flight", b.in_flight),
        );
        if (b.imported) items.push(counter("imported", b.imported, "trajectories put in by POST /v1/trajectories"));
        if (b.held_back) items.push(counter("held back", b.held_back_reason || "yes", null, true));
      }
    }
    clear(box).append(...items);
  }

  // -- the jobs list ------------------------------------------------------------------------------------------
  function jobsQuery() {
    const params = new URLSearchParams({ limit: $("f-limit").value });
    if ($("f-state").value) params.set("state", $("f-state").value);
    if ($("f-task").value.trim()) params.set("task", $("f-task").value.trim());
    return "v1/jobs?" + params.toString();
  }

  function shown(job) {
    const low = parseFloat($("f-reward-min").value);
    const high = parseFloat($("f-reward-max").value);
    if (!Number.isNaN(low) && !(job.reward !== null && job.reward >= low)) return false;
    if (!Number.isNaN(high) && !(job.reward !== null && job.reward <= high)) return false;
    const error = $("f-error").value;
    if (error === "none" && job.error_class) return false;
    if (error && error !== "none" && job.error_class !== error) return false;
    const label = $("f-label").value.trim();
    if (label) {
      const [key, ...rest] = label.split("=");
      const value = rest.join("=");
      if (!(key in job.labels)) return false;
      if (rest.length && job.labels[key] !== value) return false;
    }
    return true;
  }

  function jobRow(job) {
    const t = job.timings;
    const stages = [t.queued_s, t.init_s, t.run_s, t.eval_s].map((v) => fixed(v, 1)).join(" / ");
    const versions = job.policy_version_min === null ? "" :
      job.policy_version_min === job.policy_version_max ? String(job.policy_version_min) :
      job.policy_version_min + "\u2013" + job.policy_version_max;
    return el("tr", { dataset: { job: job.job_id, state: job.state } },
      el("td", { className: "id" }, el("a", { href: "#job=" + encodeURIComponent(job.job_id) }, job.job_id)),
      el("td", { className: "state-" + job.state }, job.state, job.filter ? " (filtered)" : ""),
      el("td", null, job.task),
      el("td", { className: "num" }, fixed(job.reward, 3)),
      el("td", null, keyValues(job.reward_components, 3)),
      el("td", { className: "num" }, job.num_turns ?? ""),
      el("td", { className: "num", title: "generate " + fixed(t.generate_s, 2) + " s, tools " + fixed(t.tools_s, 2) + " s" }, stages),
      el("td", { className: "num" }, versions),
      el("td", { className: "num" }, job.staleness ?? ""),
      el("td", { title: job.error || null }, job.error_class || ""),
      el("td", null, job.finish_reason || ""),
      el("td", null, keyValues(job.labels)),
      el("td", null, job.group || ""),
      el("td", { className: "num" }, when(job.submitted_at || job.recorded_at)),
    );
  }

  function renderJobs() {
    const rows = lastJobs.jobs.filter(shown);
    clear($("jobs").tBodies[0]).append(...rows.map(jobRow));
    $("jobs-count").textContent = rows.length + " shown of " + lastJobs.jobs.length + " listed (" + lastJobs.matched +
      " kept that match state and task); " + (lastJobs.policy_version === null ? "" : "staleness from version " + lastJobs.policy_version);
  }

  async function loadJobs() {
    const reply = await api(jobsQuery());
    if (reply.status !== 200) throw failure(reply);
    lastJobs = reply.body;
    renderJobs();
  }

  // -- one job ------------------------------------------------------------------------------------------------
  function facts(items) {
    const list = clear($("job-facts"));
    for (const [name, value] of items) {
      if (value === null || value === undefined || value === "" || (Array.isArray(value) && !value.length)) continue;
      list.append(el("div", null, el("dt", null, name), el("dd", null, value)));
    }
  }

  function showTrajectory(t) {
    const timings = keyValues(Object.fromEntries(Object.entries(t.timings).map(([k, v]) => [k, fixed(v, 2)])));
    facts([
      ["task", t.task],
      ["instance", t.instance_id],
      ["reward", fixed(t.reward, 4)],
      ["components", keyValues(t.reward_components, 4)],
      ["finish", t.finish_reason],
      ["error", t.error ? t.error.error_class + ": " + t.error.message : null],
      ["filtered", t.filter ? "yes: the trainer drops it" : null],
      ["turns", String(t.num_turns)],
      ["policy versions", t.policy_version_min + (t.policy_version_max !== t.policy_version_min ? "\u2013" + t.policy_version_max : "")],
      ["stage seconds", timings],
      ["labels", keyValues(t.labels)],
      ["group", t.group],
      ["attempt", t.attempt > 1 ? t.attempt + " (retry of " + t.retry_of + ")" : null],
      ["segments", t.segments.length ? String(t.segments.length + 1) + " token sequences" : null],
    ]);
  }

  function showConversation(t, tokens) {
    const box = clear($("conversation"));
    const own = tokens && tokens.sequences[0];
    const messages = t.prompt_messages || [];  // the chat messages the built-in agent loop rendered, where recorded
    if (messages.length) {
      const short = JSON.stringify(messages).length < 2000;  // a long system prompt starts folded
      const block = el("details", { className: "prompt-block", open: short },
        el("summary", { className: "role" }, "prompt: " + messages.length + " messages (" + t.prompt_ids.length + " tokens)"));
      for (const message of messages) {
        const content = typeof message.content === "string" ? message.content : JSON.stringify(message.content, null, 2);
        block.append(el("div", { className: "role" }, String(message.role)), el("pre", { className: "message" }, content));
      }
      box.append(block);
    } else if (own && own.prompt) {
      box.append(el("details", { className: "prompt-block" }, el("summary", { className: "role" }, "prompt (" + t.prompt_ids.length + " tokens)"),
        el("pre", { className: "prompt" }, own.prompt.join(""))));
    } else {
      box.append(el("p", { className: "muted" }, "prompt: " + t.prompt_ids.length + " tokens (the token view shows them)"));
    }
    for (const turn of t.turns) {
      const resumed = (turn.resumptions || []).map((r) => " \u2192 v" + r.policy_version + " from token " + r.offset).join("");
      const node = el("div", { className: "turn", dataset: { turn: String(turn.index) } },
        el("h3", null, "turn " + turn.index + (turn.segment ? " (sequence " + turn.segment + ")" : "") + " \u00b7 v" +
          turn.policy_version + resumed + " \u00b7 " + turn.response_tokens + " tokens \u00b7 " + (turn.finish_reason || "") +
          " \u00b7 generate " + fixed(turn.generate_s, 2) + " s, tools " + fixed(turn.tools_s, 2) + " s"),
        el("div", { className: "role" }, "assistant"),
        el("pre", { className: "text" }, turn.text),
      );
      for (const call of turn.tool_calls || []) {
        node.append(el("div", { className: "role" }, "tool call: " + call.name),
          el("pre", { className: "call" }, JSON.stringify(call.arguments, null, 2)));
      }
      if ((turn.tool_call_errors || []).length) {
        node.append(el("div", { className: "role errors" }, "tool calls that could not be parsed"),
          el("pre", { className: "errors" }, turn.tool_call_errors.join("\n")));
      }
      if (turn.observation) {
        node.append(el("div", { className: "role" }, "tool output (" + turn.observation_tokens + " tokens)"),
          el("pre", { className: "observation" }, turn.observation));
      }
      box.append(node);
    }
    for (const [name, value] of Object.entries(t.artifacts || {})) {
      box.append(el("div", { className: "role" }, "artifact: " + name), el("pre", { className: "artifact" }, value));
    }
  }

  function bucket(logprob) {
    const p = Math.exp(logprob);
    return p >= 0.9 ? 0 : p >= 0.7 ? 1 : p >= 0.5 ? 2 : p >= 0.3 ? 3 : p >= 0.1 ? 4 : 5;
  }

  function tokenSpan(text, ids, i, extra) {
    const props = { className: "tok " + (text === null ? "id " : "") + extra.className, dataset: extra.dataset, title: extra.title };
    return el("span", props, text === null ? "\u27e8" + ids[i] + "\u27e9" : text);
  }

  function showTokens(t, tokens) {
    const box = clear($("sequences"));
    const sequences = [
      { prompt_ids: t.prompt_ids, response_ids: t.response_ids, response_mask: t.response_mask, response_logprobs: t.response_logprobs },
      ...t.segments,
    ];
    sequences.forEach((seq, k) => {
      const view = tokens ? tokens.sequences[k] : { prompt: null, response: null, versions: [] };
      const starts = new Set(t.turns.filter((turn) => turn.segment === k).map((turn) => turn.response_start));
      const prompt = el("div", { className: "tokens", dataset: { sequence: String(k), part: "prompt" } });
      const line = el("div", { className: "tokens", dataset: { sequence: String(k), part: "response" } });
      seq.prompt_ids.forEach((id, i) => {
        prompt.append(tokenSpan(view.prompt ? view.prompt[i] : null, seq.prompt_ids, i,
          { className: "prompt", dataset: { part: "prompt", i: String(i) }, title: "prompt #" + i + " id " + id }));
      });
      let lastVersion = null;
      seq.response_ids.forEach((id, i) => {
        const mask = seq.response_mask[i];
        const logprob = seq.response_logprobs[i];
        const version = view.versions[i] ?? null;
        const classes = ["mask-" + mask];
        if (mask) classes.push("lp-" + bucket(logprob));
        if (version !== null) classes.push("ver-" + (((version % 6) + 6) % 6));
        if (starts.has(i)) classes.push("turn-start");
        if (version !== null && lastVersion !== null && version !== lastVersion) classes.push("version-start");
        if (version !== null) lastVersion = version;
        const title = "#" + i + " id " + id + " \u00b7 mask " + mask + (mask ? " \u00b7 logprob " + logprob.toFixed(4) +
          " (p " + Math.exp(logprob).toFixed(3) + ")" : "") + (version !== null ? " \u00b7 v" + version : "");
        const dataset = { part: "response", i: String(i), mask: String(mask), logprob: String(logprob) };
        if (version !== null) dataset.version = String(version);
        line.append(tokenSpan(view.response ? view.response[i] : null, seq.response_ids, i, { className: classes.join(" "), dataset, title }));
      });
      const label = k === 0 ? "sequence 0: the trajectory's own" : "sequence " + k + ": segment " + k;
      box.append(el("div", { className: "sequence" },
        el("h3", null, label + " \u00b7 " + seq.prompt_ids.length + " prompt + " + seq.response_ids.length + " response tokens"),
        el("details", null, el("summary", null, "the prompt: " + seq.prompt_ids.length + " tokens"), prompt), line));
    });
    if (tokens && !tokens.tokenizer) {
      box.prepend(el("p", { className: "muted" }, "no tokenizer: tokens are shown as their ids (prorl-rollout view --tokenizer NAME shows their text)"));
    }
  }

  function showLegend() {
    const legend = clear($("legend"));
    const shade = $("shade").value;
    $("tokens").className = "shade-" + shade;
    const sample = (className, text) => el("span", { className: "tok " + className }, text);
    if (shade === "logprob") {
      legend.append("p \u2265 0.9 ", sample("mask-1 lp-0", " "), "\u2265 0.7 ", sample("mask-1 lp-1", " "), "\u2265 0.5 ",
        sample("mask-1 lp-2", " "), "\u2265 0.3 ", sample("mask-1 lp-3", " "), "\u2265 0.1 ", sample("mask-1 lp-4", " "),
        "< 0.1 ", sample("mask-1 lp-5", " "), " not the policy's (mask 0) ", sample("mask-0", " "));
    } else if (shade === "mask") {
      legend.append("trained (mask 1) ", sample("mask-1", " "), " not trained (mask 0): prompt, tools, template ", sample("mask-0", " "));
    } else {
      legend.append("one colour per policy version; a dashed box marks where the version changes");
    }
  }

  async function loadJob(id) {
    const path = "v1/jobs/" + encodeURIComponent(id);
    $("job-title").textContent = "job " + id;
    clear($("conversation"));
    clear($("sequences"));
    facts([]);
    const [result, tokens] = await Promise.all([api(path + "/result"), api(path + "/tokens")]);
    if (result.status === 202) {
      facts([["state", result.body.state], ["task", result.body.task]]);
      say("job " + id + " has not finished (" + result.body.state + "): it is shown once it has");
      return;
    }
    if (result.status !== 200) throw failure(result);
    const t = result.body;
    const view = tokens.status === 200 ? tokens.body : null;
    if (!view) say("the token pieces could not be read (" + failure(tokens).message + "): ids are shown", true);
    showTrajectory(t);
    showConversation(t, view);
    showTokens(t, view);
  }

  // -- routing: #job=ID shows one job, anything else the list ---------------------------------------------------
  function selectTab(name) {
    for (const button of document.querySelectorAll("#tabs button")) button.classList.toggle("active", button.dataset.tab === name);
    $("conversation").hidden = name !== "conversation";
    $("tokens").hidden = name !== "tokens";
  }

  async function route() {
    clearTimeout(refreshTimer);
    say("");
    const job = fragment().get("job");
    $("jobs-view").hidden = Boolean(job);
    $("job-view").hidden = !job;
    try {
      await loadCounters();
      if (job) {
        selectTab(fragment().get("tab") === "tokens" ? "tokens" : "conversation");
        await loadJob(job);
      } else {
        await loadJobs();
        scheduleRefresh();
      }
      document.body.dataset.loaded = "true";  // the browser tests wait for this
    } catch (error) {
      say(error.message, true);
      document.body.dataset.loaded = "error";
    }
  }

  function scheduleRefresh() {
    clearTimeout(refreshTimer);
    if (!$("f-live").checked) return;
    refreshTimer = setTimeout(async () => {
      if (!document.hidden && !fragment().get("job")) {
        try {
          await loadCounters();
          await loadJobs();
          say("");
        } catch (error) {
          say(error.message, true);
        }
      }
      scheduleRefresh();
    }, REFRESH_MS);
  }

  function start() {
    takeTokenFromFragment();
    $("token-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const value = $("token-input").value.trim();
      if (value) sessionStorage.setItem(TOKEN_KEY, value);
      $("token-input").value = "";
      route();
    });
    $("token-forget").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      route();
    });
    for (const id of ["f-state", "f-task", "f-limit"]) $(id).addEventListener("change", () => loadJobs().catch((e) => say(e.message, true)));
    for (const id of ["f-reward-min", "f-reward-max", "f-error", "f-label"]) {
      $(id).addEventListener("input", () => lastJobs.jobs && renderJobs());
    }
    $("f-live").addEventListener("change", scheduleRefresh);
    $("filters").addEventListener("submit", (event) => event.preventDefault());
    $("token-options").addEventListener("submit", (event) => event.preventDefault());
    $("shade").addEventListener("change", showLegend);
    for (const button of document.querySelectorAll("#tabs button")) button.addEventListener("click", () => selectTab(button.dataset.tab));
    window.addEventListener("hashchange", () => {
      takeTokenFromFragment();
      route();
    });
    showLegend();
    route();
  }

  start();
})();
