// rlnode's dashboard: plain JavaScript on the checkpoint-server's routes (the SDK's own).
// The org token lives in sessionStorage and travels only as a bearer header; live views
// follow server-sent events read with fetch (EventSource cannot send a header).
"use strict";

const TOKEN_KEY = "rlnode.token";
const ENDED = new Set(["completed", "failed", "cancelled", "rejected"]);
const STATUS_OF = {
  "job.accepted": "accepted", "job.queued": "queued", "job.started": "running",
  "job.paused": "paused", "job.resumed": "running", "job.completed": "completed",
  "job.failed": "failed", "job.cancelled": "cancelled", "job.rejected": "rejected",
};

const $ = (selector, root = document) => root.querySelector(selector);
let views = new AbortController(); // aborted when the view changes: its streams end

// -- talking to the node -------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, { method = "GET", json, signal, signingIn = false } = {}) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY)}` };
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers, body, signal });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const answer = await response.json();
      message = answer.detail || (answer.error && answer.error.message) || message;
    } catch (_) { /* not JSON: the status line says it */ }
    if (response.status === 401 && !signingIn) signOut(message); // expired or revoked
    throw new ApiError(response.status, message);
  }
  return response;
}

const getJson = async (path, options) => (await api(path, options)).json();

// Server-sent events from a fetch body: yields {type, data} as blocks arrive.
async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let type = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) type = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) yield { type, data: data === "[DONE]" ? null : JSON.parse(data) };
    }
  }
}

async function follow(path, onEvent, signal) {
  try {
    for await (const event of serverEvents(await api(path, { signal }))) onEvent(event);
  } catch (error) {
    if (error.name !== "AbortError") notice(`lost the event stream ${path}: ${error.message}`);
  }
}

// -- small helpers ------------------------------------------------------------------------

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null) node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

const fixed = (value, digits = 3) =>
  value === null || value === undefined || Number.isNaN(value) ? "–" : Number(value).toFixed(digits);

function duration(seconds) {
  if (!Number.isFinite(seconds) || seconds < 0) return "–";
  if (seconds < 90) return `${Math.round(seconds)} s`;
  if (seconds < 5400) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function notice(message) {
  const box = $("#notice");
  box.textContent = message;
  box.hidden = !message;
}

function showError(id, message) {
  const box = $(id);
  box.textContent = message || "";
  box.hidden = !message;
}

function render(templateId) {
  views.abort();
  views = new AbortController();
  const main = $("#main");
  main.replaceChildren($(templateId).content.cloneNode(true));
  return views.signal;
}

function download(blob, name) {
  const link = el("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}

// -- sign in ------------------------------------------------------------------------------

let signedOutBecause = ""; // the service's word on why, shown on the sign-in page

function signOut(message) {
  sessionStorage.removeItem(TOKEN_KEY);
  signedOutBecause = message;
  if (location.hash === "#/sign-in") route();
  else location.hash = "#/sign-in"; // hashchange routes
}

function signInView() {
  render("#sign-in-view");
  showError("#sign-in-error", signedOutBecause);
  signedOutBecause = "";
  $("#nav").hidden = $("#sign-out").hidden = true;
  $("#who").textContent = "";
  $("#sign-in").addEventListener("submit", async (submitted) => {
    submitted.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
    try {
      await api("/v1/jobs", { signingIn: true });
      location.hash = "#/jobs";
    } catch (error) {
      sessionStorage.removeItem(TOKEN_KEY);
      showError("#sign-in-error", error.message);
    }
  });
}

function orgOfToken(token) {
  // The token's claims are readable (signed, not secret): the org it belongs to.
  try {
    const body = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
    return JSON.parse(atob(body + "=".repeat((4 - (body.length % 4)) % 4))).org || "";
  } catch (_) { return ""; }
}

// -- jobs ---------------------------------------------------------------------------------

function eta(job) {
  if (ENDED.has(job.status) || !job.step || !job.total_steps) return "–";
  const elapsed = (Date.parse(job.updated_at) - Date.parse(job.created_at)) / 1000;
  return duration((elapsed / job.step) * (job.total_steps - job.step));
}

function jobRow(job) {
  const cancel = ENDED.has(job.status) ? "" : el("button", {
    class: "cancel", onclick: () => cancelJob(job.job_id),
  }, "Cancel");
  return el("tr", { dataset: { job: job.job_id } },
    el("td", {}, el("a", { href: `#/jobs/${job.job_id}` }, job.name ? `${job.name} ` : "",
      el("small", {}, job.job_id))),
    el("td", { class: `state ${job.status}`, dataset: { field: "status" } }, job.status),
    el("td", { dataset: { field: "step" } }, `${job.step} / ${job.total_steps ?? "?"}`),
    el("td", { dataset: { field: "reward" } }, fixed(job.reward_mean)),
    el("td", { dataset: { field: "eta" } }, eta(job)),
    el("td", {}, job.task_app ?? "–"),
    el("td", { class: "model", title: job.model ?? "" }, (job.model ?? "–").split("/").pop()),
    el("td", {}, cancel));
}

async function jobsView() {
  const signal = render("#jobs-view");
  const jobs = new Map();
  const draw = () => {
    const rows = [...jobs.values()].sort((a, b) => b.created_at.localeCompare(a.created_at));
    $("#jobs tbody").replaceChildren(...rows.map(jobRow));
    $("#no-jobs").hidden = rows.length > 0;
  };
  let loading = null; // one listing at a time, however many events of new jobs arrive
  const load = () => (loading = loading || (async () => {
    try {
      for (const job of await getJson("/v1/jobs", { signal })) jobs.set(job.job_id, job);
      draw();
    } finally {
      loading = null;
    }
  })());
  await load();
  // Each event of the org updates its job's row; a job not listed yet brings the listing.
  follow("/v1/events", ({ data: event }) => {
    const job = jobs.get(event.job_id);
    if (!job) { load().catch(() => {}); return; }
    const status = STATUS_OF[event.type];
    if (status && !ENDED.has(job.status)) job.status = status;
    if (event.type === "train.step") {
      job.step = event.data.step;
      job.total_steps = event.data.total_steps;
      job.reward_mean = event.data.reward_mean;
    }
    job.updated_at = event.ts;
    draw();
  }, signal);
}

async function cancelJob(jobId) {
  try {
    await api(`/v1/jobs/${jobId}/cancel`, { method: "POST", json: {} });
    notice(`asked the learner to cancel ${jobId}`);
  } catch (error) {
    notice(`${jobId} was not cancelled: ${error.message}`);
  }
}

// -- start a job --------------------------------------------------------------------------

const tomlString = (value) => JSON.stringify(String(value)); // TOML basic strings are JSON's

function startView() {
  render("#start-view");
  $("#fill-toml").addEventListener("click", () => {
    const form = new FormData($("#job-form"));
    const f = (name) => form.get(name);
    $("#toml").value = [
      `name = ${tomlString(f("name"))}`, "",
      "[model]", `source = ${tomlString(f("model"))}`, "",
      "[task_app]", `name = ${tomlString(f("task_app"))}`, "",
      "[sampling]", `max_tokens = ${Number(f("max_tokens"))}`, "",
      "[training]", `steps = ${Number(f("steps"))}`, `prompts_per_step = ${Number(f("prompts"))}`,
      `group_size = ${Number(f("group"))}`, `learning_rate = ${Number(f("lr"))}`, "",
    ].join("\n");
  });
  $("#toml-file").addEventListener("change", async (changed) => {
    const file = changed.target.files[0];
    if (file) $("#toml").value = await file.text();
  });
  $("#start-job").addEventListener("click", async () => {
    showError("#start-error", "");
    const text = $("#toml").value;
    const format = text.trimStart().startsWith("{") ? "json" : "toml";
    try {
      const answer = await getJson("/v1/jobs", { method: "POST", json: { config: text, format } });
      location.hash = `#/jobs/${answer.job_id}`;
    } catch (error) {
      showError("#start-error", error.message);
    }
  });
}

// -- one job ------------------------------------------------------------------------------

function lineChart(target, title, labels, options = {}) {
  const colours = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c"];
  const width = Math.max(280, target.clientWidth || 360);
  const plot = new uPlot({
    title, width, height: 200,
    scales: { x: { time: false } },
    axes: [{ label: "step" }, {}],
    series: [{ label: "step" }, ...labels.map((label, i) => ({
      label, stroke: colours[i % colours.length], width: 1.5,
      ...(options.points ? { paths: () => null, points: { show: true, size: 7 } } : {}),
      ...(options.dash && options.dash[i] ? { dash: [4, 4] } : {}),
    }))],
  }, [[], ...labels.map(() => [])], target);
  return plot;
}

function jobView(jobId) {
  const signal = render("#job-view");
  const steps = [];
  const evals = [];
  let job = null, drawPending = false;
  const charts = {
    reward: lineChart($("#chart-reward"), "reward", ["mean", "mean + std", "mean − std"],
      { dash: [false, true, true] }),
    loss: lineChart($("#chart-loss"), "loss", ["loss", "grad norm"]),
    rate: lineChart($("#chart-rate"), "learning rate", ["learning rate"]),
    kl: lineChart($("#chart-kl"), "KL", ["kl (reference)", "mismatch kl"]),
    staleness: lineChart($("#chart-staleness"), "staleness (versions)", ["mean", "max"]),
    throughput: lineChart($("#chart-throughput"), "training tokens/s", ["tokens/s"]),
    timing: lineChart($("#chart-timing"), "seconds per step", ["generation", "training", "waiting"]),
    evaluation: lineChart($("#chart-eval"), "held-out evaluation", ["reward", "pass@1"],
      { points: true }),
  };

  const draw = () => {
    drawPending = false;
    const x = steps.map((s) => s.step);
    const column = (f) => steps.map(f);
    charts.reward.setData([x, column((s) => s.reward_mean),
      column((s) => s.reward_mean + s.reward_std), column((s) => s.reward_mean - s.reward_std)]);
    charts.loss.setData([x, column((s) => s.loss), column((s) => s.grad_norm)]);
    charts.rate.setData([x, column((s) => s.learning_rate)]);
    charts.kl.setData([x, column((s) => s.kl), column((s) => s.mismatch_kl)]);
    charts.staleness.setData([x, column((s) => s.staleness_mean), column((s) => s.staleness_max)]);
    charts.throughput.setData([x, column((s) => s.tokens_per_s)]);
    charts.timing.setData([x, column((s) => s.generation_s), column((s) => s.compute_s),
      column((s) => s.wait_s)]);
    charts.evaluation.setData([evals.map((e) => e.step), evals.map((e) => e.reward_mean),
      evals.map((e) => e.pass_at_1)]);
    for (const plot of Object.values(charts)) plot.root.parentElement.dataset.points = plot.data[0].length;
    $("#chart-eval").hidden = $("#evals-part").hidden = evals.length === 0; // a job without [eval]
    $("#steps tbody").replaceChildren(...steps.slice(-20).reverse().map((s) =>
      el("tr", { dataset: { step: s.step } },
        el("td", {}, s.step), el("td", { dataset: { field: "reward_mean" } }, fixed(s.reward_mean)),
        el("td", { dataset: { field: "reward_std" } }, fixed(s.reward_std)),
        el("td", { dataset: { field: "loss" } }, fixed(s.loss, 4)),
        el("td", { dataset: { field: "kl" } }, fixed(s.kl, 4)),
        el("td", { dataset: { field: "mismatch_kl" } }, fixed(s.mismatch_kl, 5)),
        el("td", {}, `${fixed(s.staleness_mean, 1)} (max ${s.staleness_max})`),
        el("td", { dataset: { field: "tokens_per_s" } }, fixed(s.tokens_per_s, 0)),
        el("td", {}, fixed(s.generation_s, 1)), el("td", {}, fixed(s.compute_s, 1)))));
    $("#evals tbody").replaceChildren(...evals.map((e) => el("tr", { dataset: { step: e.step } },
      el("td", {}, e.step), el("td", {}, fixed(e.reward_mean)), el("td", {}, fixed(e.pass_at_1)),
      el("td", {}, `${e.count} (${e.failed} failed)`))));
    drawFacts();
  };
  const redraw = () => { if (!drawPending) { drawPending = true; requestAnimationFrame(draw); } };

  const drawFacts = () => {
    if (!job) return;
    $("#job-title").textContent = job.name || job.job_id;
    const state = $("#job-state");
    state.textContent = job.status;
    state.className = `state ${job.status}`;
    $("#cancel-job").hidden = ENDED.has(job.status);
    const last = steps[steps.length - 1];
    const facts = {
      "job id": job.job_id, step: `${job.step} / ${job.total_steps ?? "?"}`,
      reward: fixed(job.reward_mean), ETA: eta(job), "Task App": job.task_app ?? "–",
      model: job.model ?? "–", algorithm: job.algorithm ?? "–",
      "tokens/s": last ? fixed(last.tokens_per_s, 0) : "–",
    };
    $("#job-facts").replaceChildren(...Object.entries(facts).flatMap(([k, v]) =>
      [el("dt", {}, k), el("dd", { dataset: { fact: k } }, v)]));
    showError("#job-error", job.reason && ENDED.has(job.status) ? job.reason : "");
  };

  $("#cancel-job").addEventListener("click", () => cancelJob(jobId));
  $("#rollout-filter").addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    loadRollouts(jobId, signal);
  });
  $("#chat").addEventListener("submit", (submitted) => {
    submitted.preventDefault();
    ask();
  });

  const onEvent = ({ data: event }) => {
    job = job || { job_id: jobId, status: "accepted", step: 0 };
    const status = STATUS_OF[event.type];
    if (status && !ENDED.has(job.status)) job.status = status;
    job.updated_at = event.ts;
    if (event.type === "job.accepted") {
      Object.assign(job, { total_steps: event.data.steps, model: event.data.model,
        task_app: event.data.task_app, algorithm: event.data.algorithm, name: event.data.name });
      job.created_at = job.created_at || event.ts;
    }
    if (["job.rejected", "job.failed", "job.cancelled"].includes(event.type)) {
      job.reason = event.data.reason || event.message;
    }
    if (event.type === "job.started" && job.step === 0) job.created_at = event.ts;
    if (event.type === "train.step") {
      // A resumed job trains its steps after the last checkpoint again: the latest wins.
      while (steps.length && steps[steps.length - 1].step >= event.data.step) steps.pop();
      steps.push(event.data);
      Object.assign(job, { step: event.data.step, total_steps: event.data.total_steps,
        reward_mean: event.data.reward_mean });
    }
    if (event.type === "eval.completed") {
      const at = evals.findIndex((e) => e.step === event.data.step);
      if (at >= 0) evals.splice(at, 1);
      evals.push(event.data);
      evals.sort((a, b) => a.step - b.step);
    }
    if (event.type === "rollout.sample") loadRollouts(jobId, signal);
    if (event.type === "checkpoint.saved") loadCheckpoints(jobId, signal);
    redraw();
  };

  (async () => {
    // A job just started is known once its first event is indexed: until then the service
    // says so (as it does for another org's job), and the page asks again.
    for (;;) {
      try {
        job = await getJson(`/v1/jobs/${jobId}`, { signal });
        showError("#job-error", "");
        break;
      } catch (error) {
        if (error.name === "AbortError") return;
        showError("#job-error", error.message);
        if (error.status !== 404) return;
        await new Promise((wake) => setTimeout(wake, 1000));
        if (signal.aborted) return;
      }
    }
    drawFacts();
    loadRollouts(jobId, signal);
    loadCheckpoints(jobId, signal);
    follow(`/v1/jobs/${jobId}/events`, onEvent, signal);
  })();

  async function ask() {
    showError("#chat-error", "");
    const answer = $("#chat-answer");
    answer.textContent = "";
    answer.classList.add("streaming");
    // OpenAI's routes, streamed: chat through the model's template, or the text as it is
    // (a model without a chat template answers only that way).
    const chat = $("#chat-mode").value === "chat";
    const prompt = $("#chat-prompt").value;
    const request = {
      model: $("#chat-model").value, stream: true, max_tokens: Number($("#chat-max").value),
      ...(chat ? { messages: [{ role: "user", content: prompt }] } : { prompt }),
    };
    try {
      const response = await api(chat ? "/v1/chat/completions" : "/v1/completions", {
        method: "POST", signal, json: request,
      });
      for await (const { data } of serverEvents(response)) {
        if (data === null) break;
        const choice = data.choices && data.choices[0];
        const piece = choice && (chat ? choice.delta && choice.delta.content : choice.text);
        if (piece) answer.textContent += piece;
      }
    } catch (error) {
      if (error.name !== "AbortError") showError("#chat-error", error.message);
    } finally {
      answer.classList.remove("streaming");
      answer.dataset.done = "true";
    }
  }
}

async function loadRollouts(jobId, signal) {
  const form = new FormData($("#rollout-filter"));
  const query = new URLSearchParams();
  for (const [key, value] of form.entries()) if (value !== "") query.set(key, value);
  let episodes;
  try {
    episodes = await getJson(`/v1/jobs/${jobId}/rollouts?${query}`, { signal });
  } catch (error) {
    if (error.status === 404) return; // the job is not indexed yet
    throw error;
  }
  const last = (e) => (e.turns.length ? e.turns[e.turns.length - 1].completion : "");
  $("#rollouts").dataset.query = query.toString(); // what the rows below answer
  $("#rollouts tbody").replaceChildren(...episodes.map((episode) =>
    el("tr", { class: "episode", dataset: { step: episode.step, position: episode.position },
      onclick: () => showRollout(episode) },
      el("td", {}, episode.step), el("td", {}, episode.seed), el("td", {}, episode.sample_index),
      el("td", {}, fixed(episode.reward)),
      el("td", { class: episode.status }, episode.failure_kind || episode.status),
      el("td", { class: "clip" }, last(episode).slice(0, 120)))));
}

function showRollout(episode) {
  const box = $("#rollout");
  box.hidden = false;
  box.replaceChildren(
    el("h3", {}, `step ${episode.step}, seed ${episode.seed}, sample ${episode.sample_index}: `
      + `reward ${fixed(episode.reward)} (${episode.status}, ${fixed(episode.duration_s, 2)} s)`),
    ...(episode.failure_kind
      ? [el("p", { class: "error" }, `${episode.failure_kind}: ${episode.failure_message ?? ""}`)]
      : []),
    ...episode.turns.flatMap((turn, i) => [
      el("h4", {}, `turn ${i + 1}`),
      el("pre", { class: "prompt" }, turn.prompt),
      el("pre", { class: "completion" }, turn.completion),
      el("small", {}, `finished: ${turn.finish_reason}`),
    ]));
}

async function loadCheckpoints(jobId, signal) {
  const checkpoints = await getJson(`/v1/checkpoints?job=${encodeURIComponent(jobId)}`, { signal });
  $("#checkpoints tbody").replaceChildren(...checkpoints.map((c) => {
    const files = el("button", { onclick: () => listFiles(c, files.parentElement) }, "files");
    return el("tr", { dataset: { step: c.step } },
      el("td", {}, c.model + (c.final ? " (final)" : "")),
      el("td", {}, new Date(c.created_at).toLocaleString()), el("td", {}, files));
  }));
  const select = $("#chat-model");
  const chosen = select.value;
  select.replaceChildren(...checkpoints.filter((c) => c.on_disk).reverse()
    .map((c) => el("option", { value: c.model }, c.model)));
  if (chosen) select.value = chosen;
}

async function listFiles(checkpoint, cell) {
  const base = `/v1/checkpoints/${checkpoint.job_id}/${checkpoint.step}/files`;
  const files = await getJson(base);
  cell.replaceChildren(...files.map((f) => el("button", {
    class: "file",
    onclick: async () => download(await (await api(`${base}/${encodeURIComponent(f.name)}`)).blob(), f.name),
  }, `${f.name} (${(f.size_bytes / 1e6).toFixed(1)} MB)`)));
}

// -- node ---------------------------------------------------------------------------------

async function nodeView() {
  const signal = render("#node-view");
  const node = await getJson("/v1/node", { signal });
  $("#node-supervised").textContent = node.supervised
    ? `Supervised: dead services are started again (broker restarts: ${node.broker_restarts}).`
    : "No supervisor records this node (services started one by one).";
  $("#services tbody").replaceChildren(...node.services.map((s) =>
    el("tr", { dataset: { service: s.service } }, el("td", {}, s.service),
      el("td", { class: s.healthy ? "ok" : "failed" }, s.healthy ? "healthy" : "unhealthy"),
      el("td", {}, s.restarts), el("td", {}, s.url), el("td", {}, s.problem ?? ""))));
  $("#plan tbody").replaceChildren(...node.plan.map((row) =>
    el("tr", {}, el("td", {}, row.role), el("td", {}, row.gpus), el("td", {}, row.runs))));
  const apps = Array.isArray(node.task_apps) ? node.task_apps : [];
  if (!Array.isArray(node.task_apps)) notice(`Task Apps: ${node.task_apps.error}`);
  $("#task-apps tbody").replaceChildren(...apps.map((app) => {
    const verify = app.verify || {};
    const checks = ["healthy", "accepts_key", "refuses_wrong_key"]
      .filter((k) => verify[k]).map((k) => `${k}: ${verify[k].ok ? "yes" : verify[k].detail}`);
    const managed = app.managed
      ? `pid ${app.managed.pid ?? "–"}, restarts ${app.managed.restarts}` : app.url ?? "";
    return el("tr", { dataset: { app: app.name } }, el("td", {}, app.name), el("td", {}, app.kind),
      el("td", {}, managed), el("td", { class: verify.ok ? "ok" : "failed" }, verify.ok ? "yes" : "no"),
      el("td", {}, verify.error ?? checks.join("; ")));
  }));
}

// -- routing ------------------------------------------------------------------------------

async function route() {
  notice("");
  const token = sessionStorage.getItem(TOKEN_KEY);
  const [, view, id] = location.hash.split("/");
  if (!token || view === "sign-in") return signInView();
  $("#nav").hidden = $("#sign-out").hidden = false;
  $("#who").textContent = orgOfToken(token);
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.view === (view || "jobs"));
  }
  try {
    if (view === "jobs" && id) return jobView(decodeURIComponent(id));
    if (view === "start") return startView();
    if (view === "node") return await nodeView();
    return await jobsView();
  } catch (error) {
    if (error.name !== "AbortError") notice(error.message);
  }
}

$("#sign-out").addEventListener("click", () => signOut(""));
window.addEventListener("hashchange", route);
route();
