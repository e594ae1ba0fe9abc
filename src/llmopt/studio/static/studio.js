// The studio's own script: every state-changing call goes to the JSON API with the CSRF token,
// forms become JSON the API takes, and the few pages that need more (the recipe builder, the
// evaluation form, the chat playground) get it here. No inline scripts: the page's CSP forbids them.
"use strict";

const csrf = () => document.querySelector('meta[name="csrf-token"]').content;

document.addEventListener("htmx:configRequest", (e) => { e.detail.headers["X-CSRF-Token"] = csrf(); });

// -- calling the API ----------------------------------------------------------------------------

async function api(method, url, body) {
  const options = { method, headers: { "X-CSRF-Token": csrf(), Accept: "application/json" } };
  if (body instanceof FormData) options.body = body;
  else if (body !== undefined) { options.body = JSON.stringify(body); options.headers["Content-Type"] = "application/json"; }
  const response = await fetch(url, options);
  const data = await response.json().catch(() => ({ error: `HTTP ${response.status}`, fix: "" }));
  if (!response.ok) throw Object.assign(new Error(data.error || `HTTP ${response.status}`), { fix: data.fix || "" });
  return data;
}

function showProblem(near, error) {
  const box = near.querySelector(".problem[role=alert]") || near.closest(".card, form, section")?.querySelector(".problem[role=alert]");
  if (!box) { if (error) alert(error.message); return; }
  box.textContent = error ? error.message + (error.fix ? ` — ${error.fix}` : "") : "";
  box.hidden = !error;
}

function fill(template, data) {  // "/jobs/{job.name}" with the API's answer
  return template.replace(/\{([\w.]+)\}/g, (_, path) => encodeURIComponent(path.split(".").reduce((v, k) => v?.[k], data) ?? ""));
}

function after(then, data) {
  if (!then) return;
  if (then === "reload") location.reload();
  else location.href = fill(then, data);
}

// -- forms as JSON ------------------------------------------------------------------------------

const readers = {
  int: (v) => parseInt(v, 10),
  float: (v) => parseFloat(v),
  "list-int": (v) => v.split(/[\s,]+/).filter(Boolean).map((x) => parseInt(x, 10)),
  "list-text": (v) => v.split(",").map((x) => x.trim()).filter(Boolean),
  lines: (v) => v.split("\n").map((x) => x.trim()).filter(Boolean),
  "int-or-text": (v) => (/^\d+$/.test(v.trim()) ? parseInt(v, 10) : v.trim()),
  text: (v) => v,
};

function formJSON(form) {
  const out = {};
  for (const el of form.elements) {
    if (!el.name || el.name.startsWith("_") || el.matches(":disabled") || el.type === "file" || el.dataset.inUrl !== undefined) continue;
    if (el.type === "radio" && !el.checked) continue;
    let value;
    if (el.type === "checkbox") value = el.checked;
    else {
      if (el.value.trim() === "") continue;  // left empty: the default applies
      value = (readers[el.dataset.kind] || readers.text)(el.value);
      if (typeof value === "number" && Number.isNaN(value)) value = el.value;  // the API says what is wrong with it
    }
    const path = el.name.split(".");
    let node = out;
    for (const key of path.slice(0, -1)) node = node[key] ??= {};
    node[path[path.length - 1]] = value;
  }
  return out;
}

function urlOf(form, template) {
  return template.replace(/\{(\w+)\}/g, (_, name) => encodeURIComponent(form.elements[name]?.value || ""));
}

// A form's own attributes are read with getAttribute: `form.dataset` is the input named "dataset", if it has one.
const attribute = (form, name) => HTMLElement.prototype.getAttribute.call(form, `data-${name}`);

async function submit(form, event) {
  event.preventDefault();
  const [method, template] = attribute(form, "api").split(" ");
  const button = form.querySelector("button:not([type=button])");
  const label = button?.textContent;
  if (button) { button.disabled = true; if (attribute(form, "busy")) button.textContent = attribute(form, "busy"); }
  try {
    if (form.beforeSubmit) await form.beforeSubmit();
    const data = await api(method, urlOf(form, template), formJSON(form));
    showProblem(form, null);
    after(attribute(form, "then"), data);
  } catch (error) {
    showProblem(form, error);
  } finally {
    if (button) { button.disabled = false; button.textContent = label; }
  }
}

async function press(button) {
  if (button.dataset.confirm && !confirm(button.dataset.confirm)) return;
  const [method, url] = button.dataset.api.split(" ");
  const label = button.textContent;
  button.disabled = true;
  if (button.dataset.busy) button.textContent = button.dataset.busy;
  try {
    const data = await api(method, url, method === "GET" || method === "DELETE" ? undefined : JSON.parse(button.dataset.body || "{}"));
    if (button.dataset.show) {
      const target = document.querySelector(button.dataset.show);
      target.textContent = data.command ?? JSON.stringify(data, null, 2);
      target.hidden = false;
    }
    after(button.dataset.then, data);
  } catch (error) {
    showProblem(button.closest(".card, section, div"), error);
  } finally {
    button.disabled = false;
    button.textContent = label;
  }
}

document.addEventListener("submit", (e) => { if (attribute(e.target, "api")) submit(e.target, e); });
document.addEventListener("click", (e) => {
  const button = e.target.closest("button[data-api]");
  if (button && !(button.form && attribute(button.form, "api"))) { e.preventDefault(); press(button); }
  const filler = e.target.closest("button[data-fill]");
  if (filler) {
    const form = document.querySelector(filler.dataset.fill);
    for (const [name, value] of Object.entries(JSON.parse(filler.dataset.values))) if (form.elements[name]) form.elements[name].value = value;
    form.scrollIntoView({ behavior: "smooth" });
  }
});

// -- live logs: keep the newest line in view unless the reader scrolled up ----------------------

document.addEventListener("htmx:sseBeforeMessage", (e) => {
  const log = e.detail.elt;
  if (log.classList?.contains("log")) log.dataset.stick = log.scrollHeight - log.scrollTop - log.clientHeight < 40 ? "1" : "";
});
document.addEventListener("htmx:sseMessage", (e) => {
  const log = e.detail.elt;
  if (log.classList?.contains("log") && log.dataset.stick !== "") log.scrollTop = log.scrollHeight;
});

// -- the recipe builder -------------------------------------------------------------------------

function setupBuilder() {
  const recipeBox = document.getElementById("recipe-form");
  if (!recipeBox) return;
  const jobForm = document.getElementById("job");
  const verdict = document.getElementById("verdict");
  const yamlBox = document.getElementById("yaml");
  const create = document.getElementById("create-job");
  let current = null, timer = null, asked = 0;

  const list = (items, cls) => items.map((text) => { const li = document.createElement("li"); li.className = cls; li.textContent = text; return li; });

  async function check() {
    const ticket = ++asked;
    const recipe = formJSON(document.getElementById("recipe"));
    try {
      const found = await api("POST", "/api/recipes/check", { model: jobForm.elements.model.value, recipe });
      if (ticket !== asked) return;
      current = found;
      yamlBox.textContent = found.yaml;
      const ul = document.createElement("ul");
      ul.className = "verdict";
      ul.append(...list(found.refusals, "refused"), ...list(found.warnings, "warned"));
      if (!found.refusals.length && !found.warnings.length) ul.append(...list([`Runs here: ${found.techniques.join(", ") || "no technique (the model packaged as it is)"}.`], "ok"));
      verdict.replaceChildren(ul);
      for (const section of document.querySelectorAll("#recipe > fieldset.section")) {
        const notes = found.sections[section.dataset.path] || { refusals: [], warnings: [] };
        const beside = document.createElement("ul");
        beside.className = "verdict beside";
        beside.append(...list(notes.refusals, "refused"), ...list(notes.warnings, "warned"));
        section.querySelector(":scope > ul.beside")?.remove();
        if (beside.children.length) section.querySelector(":scope > legend").after(beside);
      }
      create.disabled = found.refusals.length > 0;
    } catch (error) {
      if (ticket !== asked) return;
      current = null;
      document.querySelectorAll("#recipe ul.beside").forEach((ul) => ul.remove());
      const p = document.createElement("p");
      p.className = "problem";
      p.textContent = error.message + (error.fix ? ` — ${error.fix}` : "");
      verdict.replaceChildren(p);
      create.disabled = true;
    }
  }
  const soon = () => { clearTimeout(timer); timer = setTimeout(check, 250); };

  document.addEventListener("change", (e) => {
    const t = e.target;
    if (t.matches("[data-toggle]")) t.closest("fieldset").disabled = !t.checked;
    if (t.matches("[data-variants]")) {
      for (const variant of t.closest("fieldset").querySelectorAll(":scope > fieldset.variant")) {
        variant.disabled = variant.hidden = variant.dataset.variant !== t.value;
      }
    }
    if (t.closest("#recipe, #job")) soon();
  });
  document.addEventListener("input", (e) => { if (e.target.closest("#recipe")) soon(); });
  document.body.addEventListener("htmx:afterSwap", (e) => { if (e.detail.target === recipeBox) soon(); });

  document.getElementById("recipe-file").addEventListener("change", async (e) => {
    const file = e.target.files[0];
    if (!file) return;
    const body = new FormData();
    body.append("file", file);
    try {
      const found = await api("POST", "/api/recipes/upload", body);
      htmx.ajax("GET", `/jobs/new/form?recipe=${encodeURIComponent(JSON.stringify(found.recipe))}`, { target: recipeBox });
    } catch (error) {
      showProblem(document.getElementById("verdict-card"), error);
    }
    e.target.value = "";
  });

  document.getElementById("download-yaml").addEventListener("click", () => {
    const link = document.createElement("a");
    link.href = URL.createObjectURL(new Blob([yamlBox.textContent], { type: "application/yaml" }));
    link.download = `${current?.recipe?.name || "recipe"}.yaml`;
    link.click();
    URL.revokeObjectURL(link.href);
  });

  create.addEventListener("click", async () => {
    if (!current) return;
    create.disabled = true;
    try {
      const job = formJSON(jobForm);
      const data = await api("POST", "/api/jobs", { ...job, recipe: current.recipe });
      location.href = `/jobs/${encodeURIComponent(data.job.name)}`;
    } catch (error) {
      showProblem(document.getElementById("verdict-card"), error);
      create.disabled = false;
    }
  });
  check();
}

// -- the evaluation form ------------------------------------------------------------------------

function setupEvaluationForm() {
  const form = document.getElementById("evaluation-form");
  if (!form) return;
  const kinds = form.querySelectorAll("[data-target-kind]");
  const showTarget = () => {
    const chosen = [...kinds].find((k) => k.checked).value;
    for (const set of form.querySelectorAll("fieldset[data-target]")) set.disabled = set.hidden = set.dataset.target !== chosen;
  };
  kinds.forEach((k) => k.addEventListener("change", showTarget));
  showTarget();

  const datasetKind = document.getElementById("dataset-kind");
  const dataset = form.elements.dataset;
  const showDataset = () => {
    for (const el of form.querySelectorAll("[data-dataset]")) el.hidden = el.dataset.dataset !== datasetKind.value;
  };
  datasetKind.addEventListener("change", showDataset);
  showDataset();

  form.beforeSubmit = async () => {
    if (datasetKind.value === "synthetic") {
      dataset.value = `synthetic:${document.getElementById("synthetic-in").value},${document.getElementById("synthetic-out").value}`;
    } else if (datasetKind.value === "upload") {
      const file = document.getElementById("dataset-file").files[0];
      if (!file) throw Object.assign(new Error("choose a JSONL file"), { fix: "or pick a built-in dataset" });
      const body = new FormData();
      body.append("file", file);
      dataset.value = (await api("POST", "/api/datasets", body)).dataset;
    } else {
      dataset.value = datasetKind.value;
    }
  };
}

// -- the chat playground ------------------------------------------------------------------------

function setupChat() {
  const box = document.getElementById("chat");
  if (!box) return;
  const form = document.getElementById("chat-form");
  const messages = document.getElementById("messages");
  const stats = document.getElementById("chat-stats");
  const history = [];

  const bubble = (role, text) => {
    const div = document.createElement("div");
    div.className = `message ${role}`;
    div.textContent = text;
    messages.append(div);
    messages.scrollTop = messages.scrollHeight;
    return div;
  };

  async function send() {
    const prompt = form.elements.prompt.value.trim();
    if (!prompt) return;
    form.elements.prompt.value = "";
    history.push({ role: "user", content: prompt });
    bubble("user", prompt);
    const answer = bubble("assistant", "");
    const system = form.elements.system.value.trim();
    const body = {
      messages: system ? [{ role: "system", content: system }, ...history] : history,
      max_tokens: parseInt(form.elements.max_tokens.value, 10) || 256,
      temperature: parseFloat(form.elements.temperature.value) || 0,
    };
    showProblem(form, null);
    const response = await fetch(`/api/endpoints/${encodeURIComponent(box.dataset.endpoint)}/chat`, {
      method: "POST", headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf() }, body: JSON.stringify(body),
    });
    if (!response.ok) {
      const data = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
      showProblem(form, Object.assign(new Error(data.error), { fix: data.fix || "" }));
      history.pop();
      answer.remove();
      return;
    }
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "", tokens = 0;
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const event = /^event: (.*)$/m.exec(block)?.[1];
        const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (!event || !data) continue;
        const payload = JSON.parse(data);
        if (event === "token") { answer.textContent += payload; tokens += 1; messages.scrollTop = messages.scrollHeight; }
        else if (event === "error") showProblem(form, Object.assign(new Error(payload.error), { fix: payload.fix }));
        else if (event === "done") {
          const n = payload.usage?.completion_tokens ?? tokens;
          const decode = payload.seconds - (payload.seconds_to_first_token ?? 0);
          stats.textContent = `${n} tokens in ${payload.seconds.toFixed(2)} s · first token after ${(payload.seconds_to_first_token ?? 0).toFixed(2)} s` +
            (n > 1 && decode > 0 ? ` · ${((n - 1) / decode).toFixed(1)} tokens/s` : "");
        }
      }
    }
    history.push({ role: "assistant", content: answer.textContent });
  }

  form.addEventListener("submit", (e) => { e.preventDefault(); send(); });
  form.elements.prompt.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); send(); } });
  document.getElementById("chat-clear").addEventListener("click", () => { history.length = 0; messages.replaceChildren(); stats.textContent = ""; });
}

// -- comparing evaluations ----------------------------------------------------------------------

function setupCompare() {
  const form = document.getElementById("compare-form");
  if (!form) return;
  form.addEventListener("submit", (e) => {
    if (form.querySelectorAll('input[name="name"]:checked').length < 2) { e.preventDefault(); alert("Tick two or more evaluations to compare."); }
  });
}

document.addEventListener("DOMContentLoaded", () => { setupBuilder(); setupEvaluationForm(); setupChat(); setupCompare(); });
