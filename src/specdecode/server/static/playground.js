// The specdecode playground: streams a completion through the OpenAI-compatible API with the "specdecode"
// provenance extension and shows where each token came from. No dependencies, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const GREEDY_EPS = 1e-5; // the server decodes greedily below this temperature
const PROVENANCES = ["accepted", "resampled", "bonus", "target"];
// sent only when set; exact under speculation like temperature, top-k and top-p (README, "Sampling options")
const OPTIONS = ["min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"];
const state = { controller: null, maxK: 8, hasDraft: true, serverK: null };

class Failure extends Error {}

// ------------------------------------------------------------------------------------------ talking to the server
function requestHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

function unreachable() {
  return new Failure(`Cannot reach the server at ${location.origin}: is \`specdecode serve\` still running?`);
}

// An error response as one readable line, from OpenAI's error body when there is one.
async function failureOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
  } catch (_) { /* not JSON: keep the status line */ }
  const retry = response.headers.get("Retry-After");
  const prefix = {
    400: "Bad settings", 401: "API key needed or wrong (fill in the API key field)", 404: "Not found",
    429: `Server busy${retry ? ` (retry in ${retry} s)` : ""}`, 503: "Server unavailable",
    504: "Timed out",
  }[response.status] || `Server error ${response.status}`;
  return new Failure(`${prefix}: ${message}`);
}

async function getJSON(path) {
  let response;
  try {
    response = await fetch(path, { headers: requestHeaders() });
  } catch (_) {
    throw unreachable();
  }
  if (!response.ok) throw await failureOf(response);
  return response.json();
}

// The data payloads of a server-sent-event stream, as they arrive.
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

// ------------------------------------------------------------------------------------------ the server's models
async function loadServer() {
  const health = $("health");
  try {
    const status = await getJSON("/health");
    health.textContent = status.status === "ok" ? "ready" : status.status;
    health.className = `health ${status.status === "ok" ? "ok" : "down"}`;
  } catch (err) {
    health.textContent = "down";
    health.className = "health down";
    showError(err.message);
    return;
  }
  try {
    const models = await getJSON("/v1/models");
    const card = models.data[0];
    $("target-name").textContent = card.id;
    $("draft-name").textContent = card.draft || "none (plain decoding only)";
    $("server-k").textContent = String(card.num_speculative_tokens);
    state.hasDraft = Boolean(card.draft);
    state.serverK = card.num_speculative_tokens;
  } catch (err) {
    showError(`Model not loaded: ${err.message}`);
    return;
  }
  try { // the largest K this server accepts is documented in its OpenAPI schema
    const schema = await getJSON("/openapi.json");
    const field = schema.components.schemas.CompletionRequest.properties.num_speculative_tokens;
    const integer = (field.anyOf || [field]).find((b) => b.type === "integer");
    if (integer && Number.isInteger(integer.maximum)) state.maxK = integer.maximum;
  } catch (_) { /* keep the default range */ }
  fillKChoices();
}

function fillKChoices() {
  const select = $("k");
  select.querySelector('option[value="default"]').textContent = `server default (${state.serverK})`;
  if (!state.hasDraft) {
    select.querySelector('option[value="auto"]').remove();
    $("race").disabled = true;
    $("race").title = "the server has no draft model: there is nothing to race";
  }
  const top = state.hasDraft ? state.maxK : 0;
  for (let k = 0; k <= top; k++) {
    const option = document.createElement("option");
    option.value = String(k);
    option.textContent = k === 0 ? "0 (plain decoding)" : `${k}`;
    select.appendChild(option);
  }
}

// ------------------------------------------------------------------------------------------ settings -> request
function numberField(id, name, integer) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = Number(raw);
  if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
    throw new Failure(`Bad settings: ${name} must be ${integer ? "an integer" : "a number"}, got "${raw}"`);
  }
  return value;
}

// "50256:-100, 13:2.5" (or a JSON object) as OpenAI's logit_bias, {"50256": -100, "13": 2.5}; the server checks the
// ids against its vocabulary and the values against [-100, 100].
function logitBiasField() {
  const raw = $("logit-bias").value.trim();
  if (raw === "") return undefined;
  let pairs = null;
  try {
    pairs = raw.startsWith("{") ? Object.entries(JSON.parse(raw))
      : raw.split(",").filter((part) => part.trim()).map((part) => part.split(":"));
  } catch (_) { /* not JSON: refused below */ }
  const bias = {};
  for (const pair of pairs || [[]]) {
    const [token, value] = pair.map((part) => String(part).trim());
    if (pair.length !== 2 || !/^\d+$/.test(token) || value === "" || !Number.isFinite(Number(value))) {
      throw new Failure(`Bad settings: logit bias takes token id:value pairs separated by commas ` +
        `(50256:-100, 13:2.5), got "${raw}"`);
    }
    bias[token] = Number(value);
  }
  return bias;
}

function readSettings() {
  const prompt = $("prompt").value;
  if (!prompt.trim()) throw new Failure("Bad settings: write a prompt first");
  const settings = {
    mode: document.querySelector('input[name="mode"]:checked').value, prompt,
    k: $("k").value, max_tokens: numberField("max-tokens", "max tokens", true),
    temperature: numberField("temperature", "temperature", false), top_k: numberField("top-k", "top-k", true),
    top_p: numberField("top-p", "top-p", false), seed: numberField("seed", "seed", true),
    min_p: numberField("min-p", "min-p", false),
    presence_penalty: numberField("presence-penalty", "presence penalty", false),
    frequency_penalty: numberField("frequency-penalty", "frequency penalty", false),
    repetition_penalty: numberField("repetition-penalty", "repetition penalty", false),
    logit_bias: logitBiasField(),
  };
  return settings;
}

// The endpoint and body of a streamed request with provenance; k: "default", "auto" or a number as text.
function buildRequest(settings, k) {
  const body = { stream: true, specdecode: { provenance: true } };
  for (const name of ["max_tokens", "temperature", "top_k", "top_p", "seed", ...OPTIONS]) {
    if (settings[name] !== undefined) body[name] = settings[name];
  }
  if (k !== "default") body.num_speculative_tokens = k === "auto" ? "auto" : Number(k);
  if (settings.mode === "chat") {
    body.messages = [{ role: "user", content: settings.prompt }];
    return { path: "/v1/chat/completions", body };
  }
  body.prompt = settings.prompt;
  return { path: "/v1/completions", body };
}

// ------------------------------------------------------------------------------------------ one streamed run
// Renders one run's tokens into `output`; tracks its verification steps and statistics.
class TokenView {
  constructor(output, live) {
    this.output = output;
    this.live = live; // update the main counters and chart as tokens arrive
    this.output.textContent = "";
    this.text = "";
    this.count = 0;
    this.steps = []; // {drafts, accepted} per verification step, in order
    this.lastStep = null;
    this.stats = null;
    this.started = performance.now();
    this.seconds = 0;
    this.pending = false;
    this.done = false;
  }

  addToken(token, stats) {
    const first = this.count === 0; // the prefill's token; then each run of one step number is a step
    this.count += 1;
    if (!first && token.step !== this.lastStep) {
      this.lastStep = token.step;
      this.steps.push({ drafts: token.num_drafts, accepted: 0 });
    }
    if (!first && token.provenance === "accepted") this.steps[this.steps.length - 1].accepted += 1;
    this.stats = stats;
    this.appendText(token.text, token);
  }

  appendText(text, token) {
    this.text += text;
    if (!text) return; // a token that completes no character yet
    const follow = this.output.scrollTop + this.output.clientHeight >= this.output.scrollHeight - 4;
    const span = document.createElement("span");
    span.textContent = text;
    if (token) {
      const kind = PROVENANCES.includes(token.provenance) ? token.provenance : "target";
      span.className = `tok ${kind}`;
      span.dataset.id = token.id;
      span.dataset.step = token.step;
      span.title = `token id ${token.id} · ${kind} · step ${token.step} · ` +
        `${token.num_drafts} draft${token.num_drafts === 1 ? "" : "s"} proposed in that step`;
    }
    this.output.appendChild(span);
    if (follow) this.output.scrollTop = this.output.scrollHeight;
    this.refresh();
  }

  refresh() {
    this.seconds = (performance.now() - this.started) / 1000;
    if (!this.live || this.pending) return;
    this.pending = true; // one redraw per frame, however fast tokens come
    requestAnimationFrame(() => {
      this.pending = false;
      showCounters(this);
      drawChart(this.steps);
    });
  }

  finish() {
    this.done = true;
    this.seconds = (performance.now() - this.started) / 1000;
    if (this.live) {
      showCounters(this);
      drawChart(this.steps);
    }
  }

  get tokensPerSecond() {
    return this.seconds > 0 ? this.count / this.seconds : 0;
  }

  // The latest step's K; once the run is over, the one before the last step (the engine caps the drafts of the
  // final steps at the tokens left, so a run that ends on max_tokens ends with a short or plain step).
  get kInUse() {
    const last = this.steps.length - (this.done && this.steps.length > 1 ? 2 : 1);
    return last >= 0 ? this.steps[last].drafts : 0;
  }

  get meanK() {
    return this.steps.length ? this.steps.reduce((sum, s) => sum + s.drafts, 0) / this.steps.length : 0;
  }
}

async function streamRun(settings, k, view, signal) {
  const { path, body } = buildRequest(settings, k);
  view.started = performance.now();
  let response;
  try {
    response = await fetch(path, { method: "POST", headers: requestHeaders(), body: JSON.stringify(body), signal });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw unreachable();
  }
  if (!response.ok) throw await failureOf(response);
  let finish = null;
  try {
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Failure(`The server stopped the generation: ${chunk.error.message}`);
      const choice = (chunk.choices || [])[0];
      if (chunk.specdecode) {
        for (const token of chunk.specdecode.tokens) view.addToken(token, chunk.specdecode.stats);
      } else if (choice) { // a server without the extension: plain text
        view.appendText(choice.text || (choice.delta && choice.delta.content) || "", null);
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
    }
  } catch (err) {
    if (err.name === "AbortError" || err instanceof Failure) throw err;
    throw new Failure(`The stream broke off: ${err.message} (is the server still running?)`);
  }
  view.finish();
  return finish;
}

// ------------------------------------------------------------------------------------------ counters and chart
function percent(x) {
  return `${(100 * x).toFixed(1)}%`;
}

function showCounters(view) {
  const s = view.stats;
  $("c-tps").textContent = view.tokensPerSecond.toFixed(1);
  $("c-tokens").textContent = String(view.count);
  $("c-k").textContent = String(view.kInUse);
  $("c-k-mean").textContent = view.steps.length ? ` · mean ${view.meanK.toFixed(1)}` : "";
  $("c-acceptance").textContent = s && s.proposed_tokens ? percent(s.acceptance_rate) : "0.0%";
  $("c-mal").textContent = s ? s.mean_accepted_length.toFixed(2) : "0.00";
  $("c-steps").textContent = s ? String(s.verification_steps) : "0";
}

function resetCounters() {
  for (const id of ["c-tps", "c-acceptance", "c-mal", "c-k", "c-tokens", "c-steps"]) $(id).textContent = "–";
  $("policy").hidden = true;
  $("c-k-mean").textContent = "";
  drawChart([]);
}

function svg(name, attributes) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, String(value));
  return node;
}

// One bar per verification step (drafts kept / proposed; plain steps as a grey stub), and the running rate.
function drawChart(steps) {
  const chart = $("chart");
  chart.replaceChildren();
  const width = 600, height = 80, top = 6, usable = height - top - 2;
  const slot = width / Math.max(steps.length, 40);
  let proposed = 0, accepted = 0;
  const line = [];
  steps.forEach((step, i) => {
    const x = i * slot;
    const rate = step.drafts ? step.accepted / step.drafts : 0;
    const h = step.drafts ? Math.max(1, rate * usable) : 3;
    const bar = svg("rect", { x: x + slot * 0.1, y: height - 2 - h, width: slot * 0.8, height: h,
      class: step.drafts ? "bar" : "bar plain", fill: step.drafts ? "#7cc47c" : "#b5b5b5" });
    const title = svg("title", {});
    title.textContent = step.drafts ? `step ${i + 1}: ${step.accepted} of ${step.drafts} drafts accepted`
      : `step ${i + 1}: plain target step`;
    bar.appendChild(title);
    chart.appendChild(bar);
    proposed += step.drafts;
    accepted += step.accepted;
    if (proposed) line.push(`${(x + slot / 2).toFixed(1)},${(height - 2 - (accepted / proposed) * usable).toFixed(1)}`);
  });
  if (line.length > 1) {
    chart.appendChild(svg("polyline", { points: line.join(" "), fill: "none", stroke: "#3b73d9",
      "stroke-width": 1.5, class: "running" }));
  }
}

// ------------------------------------------------------------------------------------------ the policy's explanation
// The server's speculation policy explains its latest choice in the "explanation" label of the info metric
// specdecode_policy_info on /metrics (Prometheus text format, where \\, \" and \n are escaped in label values).
function policyExplanation(metricsText) {
  const line = metricsText.split("\n").find((l) => l.startsWith("specdecode_policy_info{"));
  if (!line) return null;
  for (const [, name, raw] of line.matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) {
    if (name === "explanation") return raw.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
  }
  return null;
}

// After a run: the policy's line under the chart; hidden when the server does not export it.
async function showPolicy() {
  const box = $("policy");
  let explanation = null;
  try {
    const response = await fetch("/metrics", { headers: requestHeaders() });
    if (response.ok) explanation = policyExplanation(await response.text());
  } catch (_) { /* no metrics: the page works without the explanation */ }
  $("policy-line").textContent = explanation || "";
  box.hidden = !explanation;
}

// ------------------------------------------------------------------------------------------ page state
function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

function setBusy(busy, status) {
  $("generate").disabled = busy;
  $("race").disabled = busy || !state.hasDraft;
  $("stop").disabled = !busy;
  $("status").textContent = status;
  document.body.dataset.state = busy ? "running" : "idle";
}

// Run `work(signal)` with the buttons locked; any failure ends up in the error box, never a blank page.
async function guarded(status, work) {
  clearError();
  let settings;
  try {
    settings = readSettings();
  } catch (err) {
    showError(err.message);
    $("status").textContent = "error";
    return;
  }
  state.controller = new AbortController();
  setBusy(true, status);
  let outcome = "done";
  try {
    await work(settings, state.controller.signal);
  } catch (err) {
    if (err.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "error";
      showError(err instanceof Failure ? err.message : `Unexpected error: ${err.message}`);
    }
  } finally {
    state.controller = null;
    setBusy(false, outcome);
  }
}

async function generate(settings, signal) {
  $("race-panel").hidden = true;
  $("output").hidden = false;
  resetCounters();
  const view = new TokenView($("output"), true);
  const finish = await streamRun(settings, settings.k, view, signal);
  $("status").dataset.finish = finish || "";
  await showPolicy();
}

// Plain (K = 0) then speculative, one after the other on the one server.
async function race(settings, signal) {
  const specK = settings.k === "0" ? "default" : settings.k;
  $("race-panel").hidden = false;
  $("race-speedup").textContent = "";
  $("race-identical").textContent = "";
  $("race-identical").className = "";
  $("race-spec-title").textContent = `speculative (K = ${specK === "default" ? state.serverK : specK})`;
  $("race-plain-stats").textContent = "running…";
  $("race-spec-stats").textContent = "waiting…";
  $("output").textContent = "";
  $("output").hidden = true; // the race shows its two outputs instead
  resetCounters();
  const plain = new TokenView($("race-plain"), false);
  const spec = new TokenView($("race-spec"), true);
  $("status").textContent = "racing: plain";
  await streamRun(settings, "0", plain, signal);
  $("race-plain-stats").textContent = laneSummary(plain);
  $("race-spec-stats").textContent = "running…";
  $("status").textContent = "racing: speculative";
  await streamRun(settings, specK, spec, signal);
  $("race-spec-stats").textContent = laneSummary(spec);
  const speedup = spec.seconds > 0 ? plain.seconds / spec.seconds : 0;
  $("race-speedup").textContent = `speedup ${speedup.toFixed(2)}× ` +
    `(plain ${plain.seconds.toFixed(2)} s, speculative ${spec.seconds.toFixed(2)} s)`;
  if (speedup < 1) {
    const note = document.createElement("div");
    note.className = "note";
    note.textContent = "Speculation did not pay here: low acceptance, or a draft too slow for its target.";
    $("race-speedup").appendChild(note);
  }
  const identical = $("race-identical");
  if (settings.temperature !== undefined && settings.temperature < GREEDY_EPS) {
    const same = plain.text === spec.text;
    identical.textContent = same ? "Greedy: the outputs are identical, as lossless speculative decoding promises."
      : "Greedy: the outputs differ.";
    identical.className = same ? "identical-yes" : "identical-no";
  } else {
    identical.textContent = "Sampled (temperature > 0): the texts may differ; both follow the target's distribution.";
  }
  await showPolicy();
}

function laneSummary(view) {
  const s = view.stats;
  const acceptance = s && s.proposed_tokens ? ` · acceptance ${percent(s.acceptance_rate)}` : "";
  return `${view.seconds.toFixed(2)} s · ${view.count} tokens · ${view.tokensPerSecond.toFixed(1)} tokens/s` +
    acceptance;
}

$("settings").addEventListener("submit", (event) => {
  event.preventDefault();
  guarded("generating", generate);
});
$("race").addEventListener("click", () => guarded("racing", race));
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
window.addEventListener("unhandledrejection", (event) => showError(`Unexpected error: ${event.reason}`));
resetCounters();
loadServer();
