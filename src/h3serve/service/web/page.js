// The h3serve web page (docs/web.md): a client of the public API and nothing more. Plain JavaScript, no build step.
//
// It reads /health (no key) for the header, /v1/models for what a request may be (its `limits`), and polls one
// job list, GET /v1/videos, every POLL_ACTIVE_MS while a job is queued or running and every POLL_IDLE_MS otherwise
// (not at all while the tab is hidden). A queued or running job's card follows the job's events instead
// (GET /v1/videos/{id}/events, at most MAX_STREAMS at once): its stage and step as they happen, and its previews;
// a job so followed does not hold the list at POLL_ACTIVE_MS, and one whose stream fails or drops goes back to the
// list's polling. Videos and previews are fetched with the key into blobs (a <video src> or <img src> cannot send
// it), and so are the events: an EventSource cannot send it either, so the page reads the stream with fetch().

const POLL_ACTIVE_MS = 1000;
const POLL_IDLE_MS = 5000;
const HEALTH_MS = 10000;
const LIST_LIMIT = 20;
// Each open event stream holds one of the few connections a browser opens to a server (6 in Chromium and Firefox
// over HTTP/1.1): enough are left for the list, the videos and the previews.
const MAX_STREAMS = 3;
const END_EVENTS = new Set(["completed", "failed", "cancelled"]);
const KEY_STORE = "h3serve.key"; // sessionStorage: this tab only
// The VAE's frame grid (h3serve.config CLIP_FRAMES, LATENTS_PER_CLIP): a request's frames snap up to 17n+5.
const CLIP_FRAMES = 17;
const LATENTS_PER_CLIP = 5;
const ACTIVE = new Set(["queued", "in_progress"]);
const STATUS_NAMES = {
  queued: "Queued", in_progress: "Rendering", completed: "Completed", failed: "Failed", cancelled: "Cancelled",
  damaged: "Damaged record",
};
const STAGE_NAMES = {
  starting: "starting", text: "text encoding", keyframes: "keyframes", layout: "layout", tables: "tables",
  denoise: "denoise", video: "video decode", audio: "audio decode",
};
const UNIT_NAMES = { denoise: "step", video: "window" };
const KINDS = ["image", "video", "audio"];
const KIND_NAMES = { image: "images", video: "videos", audio: "audio" };
const TEMPLATE = "integrated_multimodal_description: [Shot 1] \n\noverall_soundscape: \n\nnon_diegetic_music: \n";

// JSON with the integers past 2^53 kept exact, as their digits (a seed may be up to 2^63-1).
function parseJson(text) {
  return JSON.parse(text, (_key, value, context) =>
    typeof value === "number" && !Number.isSafeInteger(value) && Number.isInteger(value) && context?.source
      ? context.source
      : value);
}

// Python's round(): half to even, as the server rounds seconds * fps.
function roundHalfEven(x) {
  const r = Math.round(x);
  return Math.abs(x % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

// The frames a duration gets, as the server computes them: round(seconds * fps), then up to the next 17n+5.
function snappedFrames(seconds, frames) {
  const asked = Math.max(1, roundHalfEven(seconds * frames.fps));
  const up = asked + ((((LATENTS_PER_CLIP - asked) % CLIP_FRAMES) + CLIP_FRAMES) % CLIP_FRAMES);
  return { asked, frames: Math.max(frames.min, up) };
}

// A frame count in seconds, written as the job record writes it (3 decimals, trailing zeros dropped).
function seconds(n, fps) {
  return (n / fps).toFixed(3).replace(/\.?0+$/, "");
}

function element(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
}

// Server-sent events from a fetch() body, parsed as the HTML standard parses text/event-stream: lines end in CRLF,
// LF or CR, a line starting with ":" is a comment (the server's keep-alive), "data" lines join with newlines, and a
// blank line ends an event. `onEvent({id, name, data})` for each event; `onRead()` once the events of a read are in.
async function readEventStream(body, onEvent, onRead) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let id = null;
  let name = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    // A CR at the end may be the first half of a CRLF: it waits for the next read.
    const cut = buffer.endsWith("\r") ? buffer.length - 1 : buffer.length;
    const lines = buffer.slice(0, cut).split(/\r\n|\r|\n/);
    buffer = lines.pop() + buffer.slice(cut);
    for (const line of lines) {
      if (line === "") {
        if (data.length) onEvent({ id, name: name || "message", data: data.join("\n") });
        name = "";
        data = [];
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") name = text;
      else if (field === "data") data.push(text);
      else if (field === "id" && !text.includes("\0")) id = text;
    }
    onRead();
  }
}

class ApiFailure extends Error {
  constructor(status, error) {
    super(error.message);
    this.status = status;
    this.code = error.code;
    this.param = error.param ?? null;
  }
}

class Page {
  constructor() {
    this.$ = (id) => document.getElementById(id);
    this.model = null; // the /v1/models entry, once the key (if any) is accepted
    this.cards = new Map(); // job id -> its <li>
    this.videos = new Map(); // job id -> the object URL of its fetched MP4
    this.watched = new Set(); // jobs seen unfinished here: their video loads when they complete
    this.streams = new Map(); // job id -> its open event stream (`follow`)
    this.unstreamed = new Set(); // jobs whose stream failed or dropped: the list's polling follows them
    this.references = []; // [{file, mute}] in request order
    this.jobs = [];
    this.timer = null; // the next poll
    this.polling = false; // a list request is out
    this.pollAgain = false;
  }

  get key() {
    return sessionStorage.getItem(KEY_STORE) || "";
  }

  // ---- the API ---------------------------------------------------------------------------------------------------
  get authorization() {
    return this.key ? { Authorization: `Bearer ${this.key}` } : {};
  }

  async call(method, path, { body = null, blob = false } = {}) {
    let response;
    try {
      response = await fetch(path, { method, headers: this.authorization, body, cache: "no-store" });
    } catch (err) {
      throw new ApiFailure(0, { code: "network", message: `the server did not answer (${err.message})` });
    }
    if (response.ok) {
      return blob ? response.blob() : parseJson(await response.text());
    }
    throw await this.failure(response);
  }

  // A response that is not 2xx as an ApiFailure (a 401 locks the page).
  async failure(response) {
    let error = { code: "http", message: `HTTP ${response.status}` };
    try {
      error = parseJson(await response.text()).error ?? error;
    } catch {
      // not the API's JSON error (a proxy's page): the status says enough
    }
    const failure = new ApiFailure(response.status, error);
    if (response.status === 401) {
      this.lock(failure);
    }
    return failure;
  }

  // ---- start, the key --------------------------------------------------------------------------------------------
  start() {
    this.$("key-form").addEventListener("submit", (e) => this.useKey(e));
    this.$("forget-key").addEventListener("click", () => this.forgetKey());
    this.$("video-form").addEventListener("submit", (e) => this.submit(e));
    this.$("prompt").addEventListener("input", () => this.showPromptCount());
    this.$("prompt-template").addEventListener("click", () => this.insertTemplate());
    for (const id of ["size-by-ratio", "size-explicit"]) {
      this.$(id).addEventListener("change", () => this.showSizeMode());
    }
    this.$("seconds").addEventListener("input", () => this.showFrames());
    this.$("seed-random").addEventListener("click", () => { this.$("seed").value = ""; });
    this.$("seed-reuse").addEventListener("click", () => this.reuseLastSeed());
    for (const id of ["first-frame", "last-frame"]) {
      this.$(id).addEventListener("change", () => this.showTask());
    }
    this.$("first-clear").addEventListener("click", () => { this.$("first-frame").value = ""; this.showTask(); });
    this.$("last-clear").addEventListener("click", () => { this.$("last-frame").value = ""; this.showTask(); });
    for (const id of ["mode-keyframes", "mode-references"]) {
      this.$(id).addEventListener("change", () => this.showInputMode());
    }
    this.$("reference-files").addEventListener("change", (e) => this.addReferences(e.target));
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) {
        this.refreshHealth();
        if (this.model) this.poll();
      }
    });
    this.refreshHealth();
    setInterval(() => document.hidden || this.refreshHealth(), HEALTH_MS);
    this.connect();
  }

  async refreshHealth() {
    let health;
    try {
      health = await this.call("GET", "/health");
    } catch (err) {
      this.$("server-ready").textContent = "unreachable";
      this.$("server-problem").textContent = err.message;
      return;
    }
    const warmup = health.warmup || {};
    const ready = { ready: "ready", warming: "warming up (the startup warmup is running)", failed: "not ready" };
    this.$("server-ready").textContent = health.ready ? "ready" : (ready[health.readiness] || health.readiness);
    const p = health.profile || {};
    this.$("server-model").textContent = `${health.model} (h3serve ${health.version})`;
    this.$("server-profile").textContent =
      [p.device, p.dtype, p.attention, p.execution, p.linear].filter(Boolean).join(", ");
    this.$("server-gpus").textContent = String(health.num_gpus);
    this.$("server-queue").textContent = `${health.queue_depth} waiting`;
    const problem = health.problem || (warmup.error ? `The startup warmup failed: ${warmup.error}` : "");
    this.$("server-problem").textContent = problem;
  }

  async connect() {
    try {
      const models = await this.call("GET", "/v1/models");
      this.setUp(models.data[0]);
    } catch (err) {
      if (err.status !== 401) {
        this.$("server-problem").textContent = `Could not read the model: ${err.message}`;
      }
    }
  }

  lock(failure) {
    // A 401: show the key form, and nothing that needs the key.
    clearTimeout(this.timer);
    this.closeStreams();
    this.model = null;
    this.$("create").hidden = true;
    this.$("queue").hidden = true;
    this.$("key-section").hidden = false;
    this.$("forget-key").hidden = !this.key;
    this.$("key-message").textContent = this.key
      ? `The server refused this key (401 ${failure.code}): ${failure.message}`
      : "This server needs its API key.";
    this.$("key").focus();
  }

  useKey(event) {
    event.preventDefault();
    const key = this.$("key").value.trim();
    if (!key) {
      this.$("key-message").textContent = "Enter the key first.";
      return;
    }
    sessionStorage.setItem(KEY_STORE, key);
    this.$("key").value = "";
    this.$("key-message").textContent = "Checking the key…";
    this.connect();
  }

  forgetKey() {
    sessionStorage.removeItem(KEY_STORE);
    this.closeStreams();
    this.unstreamed.clear();
    for (const url of this.videos.values()) URL.revokeObjectURL(url);
    for (const card of this.cards.values()) this.dropPreview(card);
    this.videos.clear();
    this.cards.clear();
    this.$("jobs").replaceChildren();
    this.connect();
  }

  // ---- the form, from what the server reports -------------------------------------------------------------------
  setUp(model) {
    this.model = model;
    const limits = model.limits;
    this.$("key-section").hidden = true;
    this.$("key-message").textContent = "";
    this.$("forget-key").hidden = !this.key;
    this.$("create").hidden = false;
    this.$("queue").hidden = false;

    const size = limits.size;
    const fallback = `default: ${size.default}, or the first keyframe's aspect`;
    const ratios = [element("option", { value: "", textContent: fallback })];
    for (const [name, wh] of Object.entries(size.aspect_ratios)) {
      ratios.push(element("option", { value: name, textContent: `${name} (${wh})` }));
    }
    this.$("aspect-ratio").replaceChildren(...ratios);
    const [w, h] = size.default.split("x");
    for (const [id, value] of [["width", w], ["height", h]]) {
      Object.assign(this.$(id), { step: size.multiple, min: size.multiple, placeholder: value });
    }
    this.$("size-hint").textContent =
      `Sides are multiples of ${size.multiple}, at most ${size.max_pixels.toLocaleString("en")} pixels in all, ` +
      `width/height between ${size.min_aspect} and ${size.max_aspect}.`;

    const steps = limits.num_inference_steps;
    Object.assign(this.$("steps"), { min: steps.min, max: steps.max, placeholder: String(steps.default) });
    const adapter = model.adapters.find((a) => a.trained) || null;
    this.$("steps-hint").textContent =
      `Grid points, ${steps.min}–${steps.max}: N points run N−1 DiT forwards. Empty: ${steps.default}` +
      (adapter ? ` (the adapter's trained grid).` : ".");
    this.$("seconds").placeholder = seconds(limits.frames.default, limits.frames.fps);
    this.$("seed-hint").textContent =
      `0 to ${limits.seed.max}. Empty: the server picks a random seed and shows it on the job.`;

    this.$("quality-field").hidden = !limits.quality;
    this.$("adapter-field").hidden = model.adapters.length === 0;
    this.$("adapter-info").textContent = model.adapters.map((a) => {
      const t = a.trained;
      const known = (value) => value ?? "?";
      const trained = t
        ? `; trained for ${known(t.num_inference_steps)} steps, ` +
          `shifts ${known(t.flow_shift)}/${known(t.audio_flow_shift)}` +
          (t.tasks ? `, tasks ${t.tasks.join(", ")}` : "")
        : "";
      return `Adapter ${a.file} (${a.format}, scale ${a.scale})${trained}. It is merged at load: every request ` +
        "runs it, and one that leaves steps empty runs its trained sampler.";
    }).join(" ");

    const keyframes = model.tasks.some((t) => t !== "t2va" && t !== "ref2va");
    const references = model.tasks.includes("ref2va") && limits.references !== null;
    this.$("input-mode").hidden = !(keyframes && references);
    this.$("mode-keyframes").checked = keyframes;
    this.$("mode-references").checked = !keyframes && references;
    this.showInputMode();
    this.showPromptCount();
    this.showSizeMode();
    this.showFrames();
    this.poll();
  }

  showPromptCount() {
    const n = this.$("prompt").value.length;
    const limit = this.model.limits.prompt_chars;
    this.$("prompt-count").textContent = `${n.toLocaleString("en")} of ${limit.toLocaleString("en")} characters`;
  }

  insertTemplate() {
    const prompt = this.$("prompt");
    prompt.value = prompt.value.trim() ? `${prompt.value.trimEnd()}\n\n${TEMPLATE}` : TEMPLATE;
    prompt.focus();
    this.showPromptCount();
  }

  showSizeMode() {
    const explicit = this.$("size-explicit").checked;
    this.$("explicit-row").hidden = !explicit;
    this.$("ratio-row").hidden = explicit;
  }

  showFrames() {
    const frames = this.model.limits.frames;
    const text = this.$("seconds").value.trim();
    const out = this.$("seconds-snap");
    if (!text) {
      const n = frames.default;
      out.textContent = `Empty: the server's default, ${n} frames (${seconds(n, frames.fps)} s).`;
      return;
    }
    const value = Number(text);
    if (!Number.isFinite(value) || value <= 0) {
      out.textContent = "A duration is a number of seconds above 0.";
      return;
    }
    const { asked, frames: n } = snappedFrames(value, frames);
    let line = `${value} s at ${frames.fps} fps is ${asked} frames; the model renders ` +
      `${CLIP_FRAMES}n+${LATENTS_PER_CLIP} frames, so this video gets ${n} frames (${seconds(n, frames.fps)} s).`;
    if (n > frames.max) {
      line += ` That is above the ${frames.max} frames (${seconds(frames.max, frames.fps)} s) this model takes.`;
    }
    out.textContent = line;
  }

  reuseLastSeed() {
    const job = this.jobs.find((j) => j.seed !== undefined);
    if (job) {
      this.$("seed").value = String(job.seed);
    } else {
      this.$("seed-hint").textContent = "No job yet to take a seed from.";
    }
  }

  // ---- inputs: keyframes or references, and the task they make ----------------------------------------------------
  get inputMode() {
    return this.$("mode-references").checked ? "references" : "keyframes";
  }

  showInputMode() {
    this.$("keyframes").hidden = this.inputMode !== "keyframes";
    this.$("references").hidden = this.inputMode !== "references";
    this.showTask();
  }

  task() {
    if (this.inputMode === "references") {
      return this.references.length || !this.model.tasks.includes("t2va") ? "ref2va" : "t2va";
    }
    const first = this.$("first-frame").files.length > 0;
    const last = this.$("last-frame").files.length > 0;
    return first && last ? "fl2va" : first ? "i2va" : last ? "l2va" : "t2va";
  }

  showTask() {
    const what = {
      t2va: "text only", i2va: "from the first frame", l2va: "to the last frame",
      fl2va: "from the first frame to the last", ref2va: "from the references",
    };
    const task = this.task();
    const keyframes = [this.$("first-frame"), this.$("last-frame")].flatMap((input) => [...input.files]);
    const big = keyframes.filter((file) => this.tooBig(file)).map((file) => ` ${file.name}${this.tooBig(file)}.`);
    this.$("task-shown").textContent = `Task: ${task} (${what[task]}).${big.join("")}`;
    if (this.inputMode === "references") this.showReferences();
  }

  // A file over the server's upload cap (H3_MAX_UPLOAD_MB): said beside it; the server refuses it with a 413.
  tooBig(file) {
    const mb = this.model.limits.upload_mb;
    return file.size > mb * 2 ** 20 ? ` is over this server's upload limit of ${mb} MB` : "";
  }

  addReferences(input) {
    for (const file of input.files) this.references.push({ file, mute: false });
    input.value = "";
    this.showTask();
  }

  static kindOf(file) {
    const kind = (file.type || "").split("/")[0];
    return KINDS.includes(kind) ? kind : null;
  }

  showReferences() {
    const limits = this.model.limits.references;
    if (!limits) return;
    const counts = { image: 0, video: 0, audio: 0 };
    const items = this.references.map((ref, i) => {
      const kind = Page.kindOf(ref.file);
      if (kind) counts[kind] += 1;
      const name = `${i}: ${ref.file.name}, ${kind || "kind unknown (the server reads it from the content)"}, ` +
        `${(ref.file.size / 1e6).toFixed(1)} MB${this.tooBig(ref.file)}`;
      const li = element("li", {}, element("span", { textContent: name }));
      if (kind === "video") {
        const id = `mute-${i}`;
        const box = element("input", { type: "checkbox", id, checked: ref.mute });
        box.addEventListener("change", () => { ref.mute = box.checked; });
        li.append(box, element("label", { htmlFor: id, textContent: "leave its sound out" }));
      }
      const remove = element("button", { type: "button", textContent: "Remove" });
      remove.setAttribute("aria-label", `Remove reference ${i}, ${ref.file.name}`);
      remove.addEventListener("click", () => { this.references.splice(i, 1); this.showTask(); });
      li.append(remove);
      return li;
    });
    this.$("reference-list").replaceChildren(...items);
    const over = (n, limit) => (n > limit ? " (too many)" : "");
    const parts = KINDS.map((k) => `${KIND_NAMES[k]} ${counts[k]} of ${limits[k]}${over(counts[k], limits[k])}`);
    const total = this.references.length;
    let line = `References: ${parts.join(", ")}; ${total} of ${limits.total} in all${over(total, limits.total)}.`;
    if (counts.audio && !counts.image && !counts.video) {
      line += " An audio reference needs an image or a video beside it.";
    }
    this.$("reference-limits").textContent = line;
  }

  // ---- submit -----------------------------------------------------------------------------------------------------
  form() {
    const form = new FormData();
    const put = (name, value) => { if (value !== "") form.append(name, value); };
    put("prompt", this.$("prompt").value);
    if (this.$("size-explicit").checked) {
      put("width", this.$("width").value.trim());
      put("height", this.$("height").value.trim());
    } else {
      put("aspect_ratio", this.$("aspect-ratio").value);
    }
    put("seconds", this.$("seconds").value.trim());
    put("num_inference_steps", this.$("steps").value.trim());
    put("preview_every", this.$("preview-every").value.trim());
    put("seed", this.$("seed").value.trim());
    if (!this.$("quality-field").hidden) put("quality", this.$("quality").value);
    const task = this.task();
    const extra = { task };
    if (task === "ref2va") {
      const mute = this.references.flatMap((r, i) => (r.mute ? [i] : []));
      if (mute.length) extra.mute_references = mute;
      for (const ref of this.references) form.append("input_references", ref.file, ref.file.name);
    } else if (task !== "t2va") {
      const frames = [[this.$("first-frame"), 0], [this.$("last-frame"), -1]].filter(([input]) => input.files.length);
      extra.frame_indices = frames.map(([, index]) => index);
      for (const [input] of frames) form.append("input_references", input.files[0], input.files[0].name);
    }
    form.append("extra_params", JSON.stringify(extra));
    return form;
  }

  async submit(event) {
    event.preventDefault();
    this.clearErrors();
    const button = this.$("submit");
    button.disabled = true;
    this.$("submit-status").textContent = "Sending…";
    try {
      const job = await this.call("POST", "/v1/videos", { body: this.form() });
      this.watched.add(job.id);
      this.$("submit-status").textContent = `Queued as ${job.id} (seed ${job.seed}).`;
      this.poll();
    } catch (err) {
      this.$("submit-status").textContent = "";
      if (err.status !== 401) this.showError(err);
    } finally {
      button.disabled = false;
    }
  }

  fieldOf(param) {
    const name = param.replace(/\[\d+\]$/, "");
    return [...this.$("video-form").querySelectorAll("[data-params]")]
      .find((field) => field.dataset.params.split(/\s+/).includes(name)) || null;
  }

  showError(err) {
    const field = err.param ? this.fieldOf(err.param) : null;
    if (!field) {
      this.$("form-error").textContent = err.param ? `${err.param}: ${err.message}` : err.message;
      return;
    }
    field.querySelector(".error").textContent = err.message;
    field.classList.add("invalid");
    const inputs = [...field.querySelectorAll("input, select, textarea")];
    for (const input of inputs) input.setAttribute("aria-invalid", "true");
    const visible = inputs.find((input) => input.offsetParent !== null);
    if (visible) visible.focus();
  }

  clearErrors() {
    const form = this.$("video-form");
    this.$("form-error").textContent = "";
    for (const node of form.querySelectorAll(".field .error")) node.textContent = "";
    for (const node of form.querySelectorAll(".invalid")) node.classList.remove("invalid");
    for (const node of form.querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
  }

  // ---- the job list ---------------------------------------------------------------------------------------------
  // One list request at a time, and one timer: a poll asked for while one is out runs once it is back.
  async poll() {
    clearTimeout(this.timer);
    if (this.polling) {
      this.pollAgain = true;
      return;
    }
    if (document.hidden || !this.model) return; // visibilitychange starts it again; a new key does too
    this.polling = true;
    let active = false;
    try {
      const list = await this.call("GET", `/v1/videos?limit=${LIST_LIMIT}`);
      this.jobs = list.data;
      this.showJobs(list.data);
      // A job followed by its events needs no fast poll; the others (past MAX_STREAMS, or whose stream failed) do.
      active = list.data.some((job) => ACTIVE.has(job.status) && !this.streams.has(job.id));
      const shown = list.has_more ? `the newest ${list.data.length}` : `${list.data.length}`;
      const when = new Date().toLocaleTimeString();
      this.$("queue-status").textContent = list.data.length ? `${shown} job(s); updated ${when}.` : "No jobs yet.";
    } catch (err) {
      if (err.status !== 401) this.$("queue-status").textContent = `Could not list the jobs: ${err.message}`;
    } finally {
      this.polling = false;
    }
    if (this.pollAgain) {
      this.pollAgain = false;
      this.poll();
    } else if (this.model) {
      this.timer = setTimeout(() => this.poll(), active ? POLL_ACTIVE_MS : POLL_IDLE_MS);
    }
  }

  showJobs(jobs) {
    const list = this.$("jobs");
    const ids = new Set(jobs.map((job) => job.id));
    for (const [id, card] of this.cards) {
      if (!ids.has(id)) this.dropCard(id, card);
    }
    jobs.forEach((job, i) => {
      const card = this.cards.get(job.id) || this.newCard(job);
      this.update(card, job);
      // Move only what is out of place: a <video> taken out of the document stops playing.
      if (list.children[i] !== card) list.insertBefore(card, list.children[i] || null);
    });
    this.followJobs(jobs);
  }

  dropCard(id, card) {
    card.remove();
    this.cards.delete(id);
    this.streams.get(id)?.abort.abort();
    this.streams.delete(id);
    this.dropPreview(card);
    const url = this.videos.get(id);
    if (url) URL.revokeObjectURL(url);
    this.videos.delete(id);
  }

  newCard(job) {
    const title = `title-${job.id}`;
    const button = (cls, text) => {
      const b = element("button", { type: "button", className: cls, textContent: text });
      b.setAttribute("aria-describedby", title);
      return b;
    };
    const card = element(
      "li",
      { className: "job" },
      element("h3", { id: title, className: "job-prompt", textContent: job.prompt }),
      element("p", { className: "job-status" }),
      element("progress", { className: "job-progress", max: 100 }),
      element("p", { className: "job-stage" }),
      element("p", { className: "job-settings" }),
      element("p", { className: "job-error error" }),
      element("div", { className: "job-media" }),
      element(
        "div",
        { className: "row job-actions" },
        button("job-cancel", "Cancel"),
        button("job-delete", "Delete"),
        button("job-load", "Play here"),
        button("job-reuse", "Reuse settings"),
        button("job-reuse-seed", "Reuse seed"),
      ),
    );
    card.dataset.jobId = job.id;
    card.querySelector(".job-progress").setAttribute("aria-labelledby", title);
    card.querySelector(".job-cancel").addEventListener("click", () => this.remove(job.id));
    card.querySelector(".job-delete").addEventListener("click", () => this.remove(job.id));
    card.querySelector(".job-load").addEventListener("click", () => this.loadVideo(card.job));
    card.querySelector(".job-reuse").addEventListener("click", () => this.reuse(card.job));
    card.querySelector(".job-reuse-seed").addEventListener("click", () => {
      this.$("seed").value = String(card.job.seed);
      this.$("seed").focus();
    });
    this.cards.set(job.id, card);
    return card;
  }

  update(card, record) {
    card.job = record;
    const job = this.withEvents(record);
    card.dataset.status = job.status;
    const active = ACTIVE.has(job.status);
    if (active) this.watched.add(job.id);
    const q = (cls) => card.querySelector(`.${cls}`);
    q("job-status").textContent = `${STATUS_NAMES[job.status] || job.status} · ${job.id}`;
    q("job-progress").value = job.progress || 0;
    q("job-progress").hidden = !active;
    q("job-stage").textContent = Page.stageLine(job);
    const cache = job.step_cache && job.step_cache !== "off"
      ? `, step cache ${job.step_cache} (${(job.cached_steps || []).length} cached)` : "";
    const previews = job.preview_every ? `, a preview every ${job.preview_every} forwards` : "";
    // A record the store could not read (status "damaged", docs/api.md) has only its id and the error.
    const damaged = job.status === "damaged";
    q("job-settings").textContent = damaged
      ? "The stored record could not be read: `h3serve store check` on the server says why."
      : `${job.task}, ${job.size}, ${job.num_frames} frames (${job.seconds} s), ${job.num_inference_steps} steps, ` +
        `seed ${job.seed}, shifts ${job.flow_shift}/${job.audio_flow_shift}` +
        (job.quality ? `, quality ${job.quality}` : "") + cache + previews +
        `; created ${new Date(job.created_at * 1000).toLocaleString()}`;
    q("job-reuse").hidden = damaged;
    q("job-reuse-seed").hidden = damaged;
    q("job-error").textContent = job.error ? `${job.error.code}: ${job.error.message}` : "";
    const done = job.status === "completed";
    const loaded = this.videos.has(job.id);
    q("job-cancel").hidden = !active;
    q("job-delete").hidden = active;
    q("job-load").hidden = !done || loaded || card.loading;
    if (done && !loaded && !card.loading && this.watched.has(job.id)) this.loadVideo(job);
  }

  static stageLine(job) {
    const live = job.live;
    if (job.status === "completed") {
      return job.inference_time_s !== null ? `Rendered in ${job.inference_time_s.toFixed(2)} s.` : "Rendered.";
    }
    if (!ACTIVE.has(job.status)) return "";
    if (!live) return `${job.progress}%`;
    if (live.stage === "queued") return `Waiting: ${live.ahead} render(s) ahead.`;
    const elapsed = `${live.elapsed_s.toFixed(1)} s elapsed`;
    if (live.stage === "encode") return `Writing the MP4 · ${elapsed}.`;
    const unit = UNIT_NAMES[live.stage];
    const step = unit && live.total > 0 ? `, ${unit} ${live.done} of ${live.total}` : "";
    const p = job.progress;
    // The time left from the server's own progress weights (engine.STAGES): an estimate, said as one.
    const left = p >= 1 && p < 100 ? ` · about ${Math.ceil((live.elapsed_s * (100 - p)) / p)} s left` : "";
    return `${STAGE_NAMES[live.stage] || live.stage}${step} · ${p}% · ${elapsed}${left}.`;
  }

  async loadVideo(job) {
    const card = this.cards.get(job.id);
    if (!card || card.loading || this.videos.has(job.id)) return;
    card.loading = true;
    const media = card.querySelector(".job-media");
    media.replaceChildren(element("p", { className: "hint", textContent: "Fetching the MP4…" }));
    card.querySelector(".job-load").hidden = true;
    try {
      const blob = await this.call("GET", `/v1/videos/${encodeURIComponent(job.id)}/content`, { blob: true });
      const url = URL.createObjectURL(blob);
      this.videos.set(job.id, url);
      const video = element("video", { controls: true, preload: "metadata", src: url, className: "job-video" });
      video.setAttribute("aria-labelledby", `title-${job.id}`);
      const name = job.file_name || `${job.id}.mp4`;
      const link = element("a", { href: url, download: name, className: "job-download",
        textContent: `Download ${name} (${(blob.size / 1e6).toFixed(2)} MB)` });
      media.replaceChildren(video, link);
      this.dropPreview(card); // the video itself is here: a preview of it says nothing more
    } catch (err) {
      const message = `Could not fetch the MP4: ${err.message}`;
      media.replaceChildren(element("p", { className: "error", textContent: message }));
      card.querySelector(".job-load").hidden = false;
    } finally {
      card.loading = false;
    }
  }

  async remove(id) {
    const card = this.cards.get(id);
    try {
      const answer = await this.call("DELETE", `/v1/videos/${encodeURIComponent(id)}`);
      if (answer.deleted) {
        this.dropCard(id, card);
      } else if (card) {
        this.update(card, answer);
      }
    } catch (err) {
      if (card && err.status !== 401) card.querySelector(".job-error").textContent = err.message;
    }
    this.poll();
  }

  // ---- a job's events: GET /v1/videos/{id}/events -----------------------------------------------------------------
  // Read with fetch() and the key (an EventSource cannot send it). The render's stage and step go on the card as they
  // happen, each preview replaces the last, and the end event refreshes the card from the list (the video loads
  // then, as it does for a polled job). A stream that cannot open, or ends before the end event, leaves the job to the
  // list's polling, without a word: the card reads the same either way, only less often.
  followJobs(jobs) {
    // The render first, then the queue in the order it runs (the list is newest first).
    const waiting = jobs
      .filter((job) => ACTIVE.has(job.status) && !this.streams.has(job.id) && !this.unstreamed.has(job.id))
      .sort((a, b) => (b.status === "in_progress") - (a.status === "in_progress") || a.created_at - b.created_at);
    for (const job of waiting) {
      if (this.streams.size >= MAX_STREAMS) break;
      this.follow(job.id);
    }
  }

  follow(id) {
    // live: the render's stage, step and progress from the events (null before the first stage); clock: where the
    // elapsed time stood and when (from a record's live.elapsed_s, or the first stage event).
    const stream = { abort: new AbortController(), live: null, progress: 0, clock: null, preview: null, dirty: false };
    this.streams.set(id, stream);
    this.readEvents(id, stream);
  }

  closeStreams() {
    for (const stream of this.streams.values()) stream.abort.abort();
    this.streams.clear();
  }

  async readEvents(id, stream) {
    let ended = false;
    try {
      const response = await fetch(`/v1/videos/${encodeURIComponent(id)}/events`, {
        headers: { ...this.authorization, Accept: "text/event-stream" },
        cache: "no-store",
        signal: stream.abort.signal,
      });
      if (!response.ok) throw await this.failure(response);
      const onEvent = (event) => {
        ended = END_EVENTS.has(event.name) || ended;
        this.onEvent(id, stream, event);
      };
      await readEventStream(response.body, onEvent, () => this.showEvents(id, stream));
    } catch {
      // Refused, unreachable, or cut off: the polling below follows the job from here.
    }
    if (stream.abort.signal.aborted) return; // the card went, or the key did
    this.streams.delete(id);
    if (!ended) this.unstreamed.add(id);
    this.poll(); // the end: the record as the list has it now (the video loads); a drop: the polling resumes
  }

  onEvent(id, stream, event) {
    let data;
    try {
      data = parseJson(event.data);
    } catch {
      return;
    }
    if (event.name === "stage" || event.name === "progress") {
      stream.live = { stage: data.stage, done: data.done || 0, total: data.total || 0 };
      stream.progress = data.progress;
      stream.clock ||= { elapsed: 0, at: performance.now() };
      stream.dirty = true;
    } else if (event.name === "preview") {
      stream.preview = data;
      this.fetchPreview(id, stream);
    } else if (event.name === "status") {
      // The server no longer holds this job's events: its record, once; the polling follows it from here.
      const card = this.cards.get(id);
      if (card && data.id === id) this.update(card, data);
    }
  }

  showEvents(id, stream) {
    const card = this.cards.get(id);
    if (!stream.dirty || !card) return;
    stream.dirty = false;
    this.update(card, card.job);
  }

  // The record as the card shows it: with its stream's stage, step and progress on it while the job runs, unless the
  // record is further on (its MP4 being written, which the events do not say).
  withEvents(record) {
    const stream = this.streams.get(record.id);
    if (!stream || !ACTIVE.has(record.status)) return record;
    const now = performance.now();
    if (record.live && typeof record.live.elapsed_s === "number" && record !== stream.seen) {
      stream.seen = record;
      stream.clock = { elapsed: record.live.elapsed_s, at: now };
    }
    if (!stream.live || record.live?.stage === "encode" || (record.progress || 0) > stream.progress) return record;
    const elapsed = stream.clock ? stream.clock.elapsed + (now - stream.clock.at) / 1000 : 0;
    return { ...record, status: "in_progress", progress: stream.progress,
      live: { ...stream.live, elapsed_s: elapsed, ahead: null } };
  }

  // The latest preview, fetched with the key; one request at a time, and again if a newer one came meanwhile.
  async fetchPreview(id, stream) {
    if (stream.fetching) {
      stream.again = true;
      return;
    }
    stream.fetching = true;
    try {
      do {
        stream.again = false;
        const event = stream.preview;
        let blob;
        try {
          blob = await this.call("GET", `/v1/videos/${encodeURIComponent(id)}/preview?forward=${event.forward}`,
            { blob: true });
        } catch {
          return; // gone, or not answered: the next preview, or the video, follows
        }
        const card = this.cards.get(id);
        if (!card || card.loading || this.videos.has(id) || stream.abort.signal.aborted) return;
        this.showPreview(card, blob, event);
      } while (stream.again);
    } finally {
      stream.fetching = false;
    }
  }

  showPreview(card, blob, event) {
    let figure = card.querySelector(".job-preview");
    if (!figure) {
      figure = element("figure", { className: "job-preview" },
        element("img", { className: "job-preview-image" }), element("figcaption", { className: "hint" }));
      card.querySelector(".job-actions").before(figure); // the cancel button right below it
    }
    const img = figure.querySelector("img");
    const old = card.previewUrl;
    card.previewUrl = URL.createObjectURL(blob);
    Object.assign(img, { src: card.previewUrl, width: event.width, height: event.height,
      alt: `Preview of the first frames after DiT forward ${event.forward} of ${event.forwards}` });
    figure.querySelector("figcaption").textContent =
      `Preview after forward ${event.forward}/${event.forwards} (the first frames as they stand).`;
    if (old) URL.revokeObjectURL(old);
  }

  dropPreview(card) {
    card.querySelector(".job-preview")?.remove();
    if (card.previewUrl) URL.revokeObjectURL(card.previewUrl);
    card.previewUrl = null;
  }

  reuse(job) {
    this.$("prompt").value = job.prompt;
    const [w, h] = job.size.split("x");
    this.$("size-explicit").checked = true;
    this.$("width").value = w;
    this.$("height").value = h;
    this.$("seconds").value = job.seconds;
    this.$("steps").value = job.num_inference_steps;
    this.$("preview-every").value = job.preview_every ? String(job.preview_every) : "";
    this.$("seed").value = String(job.seed);
    if (job.quality) this.$("quality").value = job.quality;
    this.showSizeMode();
    this.showFrames();
    this.showPromptCount();
    this.$("prompt").focus();
  }
}

new Page().start(); // a module runs once the document is parsed
