// The clef-gguf decision playground. Plain script, no dependencies, served with a strict CSP.
// Every piece of text that comes from a request, a response or the user is put into the page with
// textContent or a form control's value, never as markup.
//
// JSON is read with an order-keeping reader (below) instead of JSON.parse: question ids and choice
// options keep the user's order on the wire (it reaches the prompt), and JSON.parse would move
// integer-like keys first and turn 1.0 into 1.
"use strict";

(function () {
  const HISTORY_KEY = "clef-gguf.history";
  const API_KEY = "clef-gguf.api-key";
  const HISTORY_MAX = 20;
  const MAX_DEPTH = 512;  // the server's nesting limit (clef_gguf/pipeline/request.py)
  // The server's default limits, checked before a request with pictures is sent, with the messages
  // the server would give (tests/server/test_ui.py checks these equal the Python constants). A
  // server that lists its own under "limits" in GET /v1/models replaces them.
  const MAX_BODY_BYTES = 32 * 1024 * 1024;  // serve --max-body-bytes (clef_gguf/server/app.py DEFAULT_MAX_BODY)
  const MAX_IMAGES = 32;  // pictures per request (clef_gguf/media/sources.py DEFAULT_MAX_IMAGES)
  const HISTORY_REQUEST_MAX = 200000;  // characters: a bigger request is kept without its pictures
  const NOUL_DEFAULTS = {
    true: "The proposition is true or the answer is yes.",
    false: "The proposition is false or the answer is no.",
  };

  // ------------------------------------------------------------------ ordered JSON values
  // A value is {k: "o", e: [[key, value], ...]} | {k: "a", v: [values]} | {k: "s", v: string}
  // | {k: "n", v: "number as written"} | {k: "b", v: bool} | {k: "z"} (null).
  class JsonError extends Error {
    constructor(message, path) { super(message); this.path = path; }
  }

  function parseJson(text) {
    let i = 0;
    const path = [];
    const lineCol = (at) => {
      const before = text.slice(0, at).split("\n");
      return "line " + before.length + ", column " + (before[before.length - 1].length + 1);
    };
    const fail = (what) => { throw new JsonError(what + " at " + lineCol(i), path.join(".")); };
    const ws = () => { while (i < text.length && " \t\n\r".includes(text[i])) i++; };
    const str = () => {
      const m = /^"(?:[^"\\\u0000-\u001f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"/.exec(text.slice(i));
      if (!m) fail("a string is not closed or holds a bad escape");
      i += m[0].length;
      return JSON.parse(m[0]);
    };
    const value = (depth) => {
      if (depth > MAX_DEPTH) fail("nested deeper than " + MAX_DEPTH + " levels");
      ws();
      const c = text[i];
      if (c === "{") {
        i++;
        const e = [];
        const seen = new Set();
        ws();
        if (text[i] === "}") { i++; return {k: "o", e}; }
        for (;;) {
          ws();
          if (text[i] !== '"') fail("expected a key in double quotes");
          const key = str();
          if (seen.has(key)) fail("the key " + JSON.stringify(key) + " appears twice");
          seen.add(key);
          ws();
          if (text[i] !== ":") fail("expected ':'");
          i++;
          path.push(key);
          e.push([key, value(depth + 1)]);
          path.pop();
          ws();
          if (text[i] === ",") { i++; continue; }
          if (text[i] === "}") { i++; return {k: "o", e}; }
          fail("expected ',' or '}'");
        }
      }
      if (c === "[") {
        i++;
        const v = [];
        ws();
        if (text[i] === "]") { i++; return {k: "a", v}; }
        for (;;) {
          path.push(v.length);
          v.push(value(depth + 1));
          path.pop();
          ws();
          if (text[i] === ",") { i++; continue; }
          if (text[i] === "]") { i++; return {k: "a", v}; }
          fail("expected ',' or ']'");
        }
      }
      if (c === '"') return {k: "s", v: str()};
      const m = /^(?:-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null)/.exec(text.slice(i, i + 400));
      if (!m) fail(i >= text.length ? "the text ends too early" : "unexpected " + JSON.stringify(c));
      i += m[0].length;
      if (m[0] === "true" || m[0] === "false") return {k: "b", v: m[0] === "true"};
      if (m[0] === "null") return {k: "z"};
      return {k: "n", v: m[0]};
    };
    const out = value(0);
    ws();
    if (i < text.length) fail("unexpected text after the value");
    return out;
  }

  function dump(node, indent, level) {
    level = level || 0;
    const pad = indent ? "\n" + " ".repeat(indent * (level + 1)) : "";
    const end = indent ? "\n" + " ".repeat(indent * level) : "";
    const sep = indent ? ": " : ":";
    switch (node.k) {
      case "o":
        if (!node.e.length) return "{}";
        return "{" + node.e.map(([key, v]) => pad + JSON.stringify(key) + sep + dump(v, indent, level + 1))
          .join(",") + end + "}";
      case "a":
        if (!node.v.length) return "[]";
        return "[" + node.v.map((v) => pad + dump(v, indent, level + 1)).join(",") + end + "]";
      case "s": return JSON.stringify(node.v);
      case "n": return node.v;
      case "b": return node.v ? "true" : "false";
      default: return "null";
    }
  }

  const S = (v) => ({k: "s", v});
  const obj = (entries) => ({k: "o", e: entries.filter((e) => e[1] !== undefined)});
  const get = (node, key) => {
    if (!node || node.k !== "o") return undefined;
    const hit = node.e.find((e) => e[0] === key);
    return hit ? hit[1] : undefined;
  };
  const num = (node) => (node && node.k === "n" ? Number(node.v) : NaN);
  const text = (node) => (node && node.k === "s" ? node.v : undefined);

  // ------------------------------------------------------------------ small DOM helpers
  const $ = (id) => document.getElementById(id);
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else if (k === "value") e.value = v;
      else if (k === "dataset") Object.assign(e.dataset, v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }
  let uid = 0;
  const nextId = (prefix) => prefix + "-" + (++uid);
  const fmt = (p) => Number(p).toFixed(4);

  // ------------------------------------------------------------------ the question model
  // A question: {key, id, type, instructions: node|undefined, noul: {true, false}, options:
  // [{id, desc: node|null}], levels: [node], extra: [[k, node]], raw: node|null}. `raw` holds a
  // question the form cannot edit (wrong shapes): it is sent as is and edited in the JSON view.
  let questions = [];
  let qkey = 0;

  function newQuestion(type) {
    const q = {key: ++qkey, id: "", type, instructions: undefined, noul: {}, options: [], levels: [],
      extra: [], raw: null, order: null};
    if (type === "choice") q.options = [{id: "", desc: null}, {id: "", desc: null}];
    if (type === "score") q.levels = [S(""), S("")];
    return q;
  }

  function questionFromNode(id, node) {
    const q = newQuestion("noul");
    q.id = id;
    const type = text(get(node, "type"));
    const criteria = get(node, "criteria");
    const fits = node.k === "o" && ["noul", "choice", "score"].includes(type) && (
      (type === "noul" && (criteria === undefined || (criteria.k === "o" &&
        criteria.e.every(([k]) => k === "true" || k === "false")))) ||
      (type === "choice" && criteria && criteria.k === "o") ||
      (type === "score" && criteria && criteria.k === "a"));
    if (!fits) { q.raw = node; q.type = type || "?"; return q; }
    q.type = type;
    q.options = [];
    q.levels = [];
    q.order = node.e.map((e) => e[0]);
    for (const [k, v] of node.e) {
      if (k === "type") continue;
      if (k === "instructions") q.instructions = v;
      else if (k === "criteria") {
        if (type === "noul") for (const [o, d] of v.e) q.noul[o] = d;
        if (type === "choice") q.options = v.e.map(([o, d]) => ({id: o, desc: d.k === "z" ? null : d}));
        if (type === "score") q.levels = v.v.slice();
      } else q.extra.push([k, v]);
    }
    return q;
  }

  function questionNode(q) {
    if (q.raw) return q.raw;
    let criteria;
    if (q.type === "noul") {
      const e = ["true", "false"].filter((o) => q.noul[o] !== undefined).map((o) => [o, q.noul[o]]);
      criteria = e.length ? obj(e) : undefined;
    } else if (q.type === "choice") {
      criteria = obj(q.options.map((o) => [o.id, o.desc === null ? {k: "z"} : o.desc]));
    } else {
      criteria = {k: "a", v: q.levels.slice()};
    }
    const entries = [["type", S(q.type)], ["instructions", q.instructions], ["criteria", criteria],
      ...q.extra];
    if (q.order) {  // the keys in the order they were written in the JSON view
      const rank = (k) => (q.order.includes(k) ? q.order.indexOf(k) : q.order.length);
      entries.sort((a, b) => rank(a[0]) - rank(b[0]));
    }
    return obj(entries);
  }

  const questionsNode = () => obj(questions.map((q) => [q.id, questionNode(q)]));

  // ------------------------------------------------------------------ the question form
  // A text control bound to a value that may be any JSON: strings are edited here, anything else
  // is shown read-only (edit it in the JSON view).
  function valueInput(label, node, placeholder, onText, multiline) {
    const id = nextId("f");
    const isText = node === undefined || node === null || node.k === "s";
    const control = el(multiline ? "textarea" : "input", {
      id, rows: multiline ? 2 : undefined, placeholder: isText ? placeholder : undefined,
      readonly: !isText, spellcheck: "false",
      value: isText ? (node ? node.v : "") : dump(node),
      oninput: (ev) => onText(ev.target.value),
    });
    const lab = el("label", {for: id, text: label});
    if (!isText) lab.append(el("span", {class: "hint", text: " (a JSON value: edit it in the JSON view)"}));
    return el("div", {class: "field"}, lab, control);
  }

  function renderQuestions(focusKey, focusWhat) {
    const list = $("questions-form");
    list.replaceChildren();
    questions.forEach((q, index) => list.append(questionCard(q, index)));
    if (focusKey !== undefined) {
      const card = list.querySelector('[data-key="' + focusKey + '"]');
      const target = card && (card.querySelector("[data-focus=" + (focusWhat || "id") + "]") ||
        card.querySelector("input, select, textarea, button"));
      if (target) target.focus();
    }
  }

  function questionCard(q, index) {
    const n = index + 1;
    const title = el("legend", {text: "Question " + n + " (" + q.type + ")"});
    const idField = nextId("f");
    const head = el("div", {class: "row"},
      el("label", {for: idField, text: "Id"}),
      el("input", {id: idField, value: q.id, spellcheck: "false", "data-focus": "id", class: "qid",
        oninput: (ev) => { q.id = ev.target.value; changed(); }}));
    const moves = el("div", {class: "row tools"},
      el("button", {type: "button", text: "Move up", disabled: index === 0,
        "aria-label": "Move question " + n + " up", "data-focus": "up",
        onclick: () => { move(index, -1); renderQuestions(q.key, "up"); }}),
      el("button", {type: "button", text: "Move down", disabled: index === questions.length - 1,
        "aria-label": "Move question " + n + " down", "data-focus": "down",
        onclick: () => { move(index, 1); renderQuestions(q.key, "down"); }}),
      el("button", {type: "button", text: "Delete", "aria-label": "Delete question " + n,
        onclick: () => {
          questions.splice(index, 1);
          changed();
          const next = questions[Math.min(index, questions.length - 1)];
          renderQuestions(next ? next.key : undefined);
          if (!next) $("add-noul").focus();
        }}));
    const error = el("p", {class: "field-error", role: "alert", "data-error": "question"});
    const card = el("fieldset", {class: "question", dataset: {key: String(q.key)}}, title, head);
    if (q.raw) {
      card.append(el("p", {class: "hint", text: "This question is not in a shape the form edits; " +
        "it is sent as written. Edit it in the JSON view."}),
      el("pre", {class: "raw", text: dump(q.raw, 2)}));
    } else {
      const typeId = nextId("f");
      head.append(
        el("label", {for: typeId, text: "Type"}),
        el("select", {id: typeId, onchange: (ev) => {
          const fresh = newQuestion(ev.target.value);
          Object.assign(q, {type: fresh.type, noul: {}, options: fresh.options, levels: fresh.levels});
          changed();
          renderQuestions(q.key, "type");
        }, "data-focus": "type"}, ...["noul", "choice", "score"].map((t) =>
          el("option", {value: t, text: t, selected: t === q.type}))));
      card.append(valueInput("Instructions", q.instructions, "defaults to the id", (v) => {
        q.instructions = v === "" ? undefined : S(v); changed();
      }, true));
      card.append(criteriaEditor(q));
      if (q.extra.length) {
        card.append(el("p", {class: "hint", text: "Also sent: " + q.extra.map((e) => e[0]).join(", ") +
          " (the server ignores these keys and names them in warnings)"}));
      }
    }
    card.append(moves, error);
    return el("li", {dataset: {key: String(q.key)}}, card);
  }

  function criteriaEditor(q) {
    const box = el("div", {class: "criteria"});
    if (q.type === "noul") {
      for (const o of ["true", "false"]) {
        box.append(valueInput("Meaning of " + o, q.noul[o], NOUL_DEFAULTS[o], (v) => {
          q.noul[o] = v === "" ? undefined : S(v); changed();
        }));
      }
      return box;
    }
    const rows = q.type === "choice" ? q.options : q.levels;
    const what = q.type === "choice" ? "option" : "level";
    rows.forEach((row, i) => {
      const line = el("div", {class: "row option"});
      if (q.type === "choice") {
        const oid = nextId("f");
        line.append(el("div", {class: "field"}, el("label", {for: oid, text: "Option " + (i + 1) + " id"}),
          el("input", {id: oid, value: row.id, spellcheck: "false", class: "option-id",
            "data-focus": i === rows.length - 1 ? "last-option" : undefined,
            oninput: (ev) => { row.id = ev.target.value; changed(); }})));
        line.append(valueInput("Description", row.desc === null ? undefined : row.desc, "none", (v) => {
          row.desc = v === "" ? null : S(v); changed();
        }));
      } else {
        line.append(valueInput("Level " + i, row, "what level " + i + " means", (v) => {
          rows[i] = S(v); changed();
        }));
      }
      line.append(el("button", {type: "button", text: "Remove",
        "aria-label": "Remove " + what + " " + (q.type === "choice" ? i + 1 : i),
        onclick: () => { rows.splice(i, 1); changed(); renderQuestions(q.key, "add-" + what); }}));
      box.append(line);
    });
    box.append(el("button", {type: "button", text: "Add " + what, "data-focus": "add-" + what,
      onclick: () => {
        rows.push(q.type === "choice" ? {id: "", desc: null} : S(""));
        changed();
        renderQuestions(q.key, q.type === "choice" ? "last-option" : "add-" + what);
      }}));
    return box;
  }

  function move(index, by) {
    const [q] = questions.splice(index, 1);
    questions.splice(index + by, 0, q);
    changed();
  }

  function addQuestion(type) {
    if (!formView()) return;
    const q = newQuestion(type);
    questions.push(q);
    changed();
    renderQuestions(q.key, "id");
  }

  // ------------------------------------------------------------------ pictures
  // The request's `images`, in order: {node (the JSON value sent: a data URI), name, size (bytes),
  // url (the thumbnail's object URL, made here from those bytes; null when there is none)}.
  let pictures = [];
  let picturesNote = "";
  const limits = {body: MAX_BODY_BYTES, images: MAX_IMAGES};
  let adding = Promise.resolve();

  const kb = (n) => (n < 1024 ? n + " B" : n < 1048576 ? (n / 1024).toFixed(1) + " KB" : (n / 1048576).toFixed(1) + " MB");

  // Files from the picker, a drop or a paste, read as data URIs and added in their order (one batch
  // after the other, so that a second drop never lands before the first).
  function addPictures(fileList) {
    const files = Array.from(fileList || []);
    adding = adding.then(() => readPictures(files));
    return adding;
  }

  async function readPictures(files) {
    const refused = [];
    const read = await Promise.all(files.map((file) => {
      if (!/^image\//.test(file.type)) { refused.push(file.name || "a file"); return null; }
      return new Promise((resolve) => {
        const reader = new FileReader();
        reader.onload = () => resolve({node: S(reader.result), name: file.name, size: file.size,
          url: URL.createObjectURL(file)});
        reader.onerror = () => { refused.push(file.name || "a file"); resolve(null); };
        reader.readAsDataURL(file);
      });
    }));
    pictures.push(...read.filter(Boolean));
    picturesNote = "";
    renderPictures();
    changed();
    if (refused.length) setError("images-error", "Not a picture: " + refused.join(", ") + " (PNG, JPEG, GIF or WebP).");
  }

  // A data URI's bytes as a Blob, for the thumbnail of a picture loaded from the history.
  function blobOf(uri) {
    const m = /^data:([^;,]*)((?:;[^;,]*)*);base64,/.exec(uri.slice(0, 200));
    if (!m) return null;
    try {
      const bin = atob(uri.slice(m[0].length));
      const bytes = new Uint8Array(bin.length);
      for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
      return new Blob([bytes], {type: m[1]});
    } catch (e) { return null; }
  }

  function pictureFrom(node) {
    const blob = node.k === "s" ? blobOf(node.v) : null;
    return {node, name: "", size: blob ? blob.size : dump(node).length, url: blob ? URL.createObjectURL(blob) : null};
  }

  function setPictures(list, note) {
    for (const p of pictures) if (p.url) URL.revokeObjectURL(p.url);
    pictures = list;
    picturesNote = note || "";
    renderPictures();
  }

  const pictureName = (p, n) => "picture " + n + (p.name ? " (" + p.name + ")" : "");

  function renderPictures(focusIndex) {
    const list = $("images-list");
    list.replaceChildren(...pictures.map((p, i) => {
      const name = pictureName(p, i + 1);
      return el("li", {class: "thumb", dataset: {index: String(i)}},
        p.url ? el("img", {src: p.url, alt: name[0].toUpperCase() + name.slice(1)}) : null,
        el("span", {class: "thumb-label", text: (i + 1) + ". " + (p.name || (p.url ? "picture" : dump(p.node).slice(0, 40))) + " · " + kb(p.size)}),
        el("button", {type: "button", text: "Remove", "aria-label": "Remove " + name,
          onclick: () => removePicture(i)}));
    }));
    const total = pictures.reduce((sum, p) => sum + p.size, 0);
    $("images-status").textContent = (pictures.length ? pictures.length + (pictures.length === 1 ? " picture, " : " pictures, ") + kb(total) + "." : "") +
      (picturesNote ? " " + picturesNote : "");
    if (focusIndex !== undefined) {
      const buttons = list.querySelectorAll("button");
      (buttons[Math.min(focusIndex, buttons.length - 1)] || $("images-input")).focus();
    }
  }

  function removePicture(index) {
    const [p] = pictures.splice(index, 1);
    if (p && p.url) URL.revokeObjectURL(p.url);
    picturesNote = "";
    changed();
    renderPictures(index);
  }

  // The count limit, as the server words it (clef_gguf/media/sources.py check_count, core/refusals.py).
  function checkPictures() {
    if (pictures.length <= limits.images) return true;
    setError("images-error", pictures.length + " images or video frames, over the limit of " + limits.images +
      ": the canvas holds " + limits.images + " images or video frames (media_too_large, field images)");
    return false;
  }

  // ------------------------------------------------------------------ views and validation
  const formView = () => $("questions-view-form").checked;
  const stateIsJson = () => $("state-mode-json").checked;

  function changed() {
    clearErrors();
  }

  function setError(id, message) {
    const slot = $(id);
    slot.textContent = message || "";
    const control = {"state-error": "state", "questions-json-error": "questions-json"}[id];
    if (control) {
      if (message) $(control).setAttribute("aria-invalid", "true");
      else $(control).removeAttribute("aria-invalid");
    }
  }

  function clearErrors() {
    for (const id of ["questions-error", "options-error", "request-error", "model-error", "images-error"]) setError(id, "");
    document.querySelectorAll("[data-error=question]").forEach((p) => { p.textContent = ""; });
    document.querySelectorAll(".question [aria-invalid]").forEach((c) => c.removeAttribute("aria-invalid"));
    checkState();
    checkPictures();
  }

  function checkState() {
    if (!stateIsJson()) { setError("state-error", ""); return null; }
    try {
      const node = parseJson($("state").value);
      setError("state-error", "");
      return node;
    } catch (e) {
      setError("state-error", "Not valid JSON: " + e.message);
      return undefined;
    }
  }

  function stateNode() {
    if (!stateIsJson()) return S($("state").value);
    const node = checkState();
    if (node === undefined) throw new FieldError("state");
    return node;
  }

  class FieldError extends Error {}

  function showQuestionsJson() {
    $("questions-json").value = dump(questionsNode(), 2);
    setError("questions-json-error", "");
    $("questions-form-view").hidden = true;
    $("questions-json-view").hidden = false;
  }

  function readQuestionsJson() {
    let node;
    try {
      node = parseJson($("questions-json").value);
    } catch (e) {
      setError("questions-json-error", "Not valid JSON: " + e.message);
      return false;
    }
    if (node.k !== "o") {
      setError("questions-json-error", "questions must be a JSON object {id: question}");
      return false;
    }
    const byId = new Map(questions.map((q) => [q.id, q.key]));
    questions = node.e.map(([id, q]) => {
      const out = questionFromNode(id, q);
      if (byId.has(id)) out.key = byId.get(id);  // keeps focus and error slots stable
      return out;
    });
    setError("questions-json-error", "");
    return true;
  }

  function showQuestionsForm() {
    if (!readQuestionsJson()) {
      $("questions-view-json").checked = true;
      $("questions-json").focus();
      return;
    }
    $("questions-json-view").hidden = true;
    $("questions-form-view").hidden = false;
    renderQuestions();
  }

  function currentQuestions() {
    if (!formView() && !readQuestionsJson()) throw new FieldError("questions-json");
    const seen = new Set();
    for (const q of questions) {
      if (seen.has(q.id)) {
        const message = "Two questions have the id " + JSON.stringify(q.id) + "; ids must differ.";
        if (formView()) questionError(q.id, message, true); else setError("questions-json-error", message);
        throw new FieldError("questions");
      }
      seen.add(q.id);
    }
    return questionsNode();
  }

  // The request as an ordered JSON value; throws FieldError (already shown) when a field is invalid.
  function buildRequest() {
    clearErrors();
    const entries = [];
    if (models.length > 1) entries.push(["model", S($("model-picker").value)]);
    entries.push(["state", stateNode()]);
    if (pictures.length) {
      if (!checkPictures()) throw new FieldError("images");
      entries.push(["images", {k: "a", v: pictures.map((p) => p.node)}]);
    }
    entries.push(["questions", currentQuestions()]);
    const options = [];
    if ($("opt-truncate").checked) options.push(["truncate_state", {k: "b", v: true}]);
    if ($("opt-strict").checked) options.push(["strict", {k: "b", v: true}]);
    if (options.length) entries.push(["options", obj(options)]);
    if ($("opt-evidence").value) {
      const grid = $("opt-evidence-grid").checked ? [["grid", {k: "b", v: true}]] : [];
      entries.push(["evidence", obj([["mode", S($("opt-evidence").value)], ...grid])]);
    }
    return obj(entries);
  }

  function loadRequest(node, droppedPictures) {
    const images = get(node, "images");
    setPictures(images && images.k === "a" ? images.v.map(pictureFrom) : [], droppedPictures
      ? "This run had " + droppedPictures + (droppedPictures === 1 ? " picture" : " pictures") + ", too large to keep in the history: add them again." : "");
    const state = get(node, "state");
    if (state && state.k === "s") {
      $("state-mode-text").checked = true;
      $("state").value = state.v;
    } else {
      $("state-mode-json").checked = true;
      $("state").value = state ? dump(state, 2) : "";
    }
    const qs = get(node, "questions");
    questions = qs && qs.k === "o" ? qs.e.map(([id, q]) => questionFromNode(id, q)) : [];
    const options = get(node, "options");
    $("opt-truncate").checked = !!(get(options, "truncate_state") || {}).v;
    $("opt-strict").checked = !!(get(options, "strict") || {}).v;
    const evidence = get(node, "evidence");
    $("opt-evidence").value = !evidence || evidence.k === "z" || (evidence.k === "b" && !evidence.v) ? ""
      : text(get(evidence, "mode")) || "attention";
    $("opt-evidence-grid").checked = !!evidence && evidence.k === "o" && !!(get(evidence, "grid") || {}).v;
    if (formView()) renderQuestions(); else showQuestionsJson();
    clearErrors();
    pickModelOf(node);
  }

  // A loaded run asks for the model it named (none: the default, which answered it); one this
  // server does not list leaves the picker as it is, and says so.
  function pickModelOf(request) {
    if (models.length < 2) return;
    const named = get(request, "model");
    const want = named === undefined ? defaultModel : text(named);
    const picker = $("model-picker");
    if (want !== undefined && models.includes(want)) {
      if (picker.value !== want) { picker.value = want; showModel(); }
      return;
    }
    setError("model-error", "This run named the model " + (want === undefined ? dump(named) : want) +
      ", which this server does not list; it will be sent to " + picker.value + ".");
  }

  // ------------------------------------------------------------------ the API
  let models = [];        // the names /v1/models lists, the default first
  let modelList = [];     // their entries as listed (ordered JSON values)
  let defaultModel;       // the name of the one marked "default": true
  let baseline = null;
  let lastResult = null;

  function headers(json) {
    const h = {Accept: "application/json"};
    if (json) h["Content-Type"] = "application/json";
    const key = sessionStorage.getItem(API_KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function readBody(response) {
    const raw = await response.text();
    try { return {raw, node: parseJson(raw)}; } catch (e) { return {raw, node: null}; }
  }

  function apiError(node, status) {
    const err = get(node, "error");
    return {code: text(get(err, "code")) || "http_" + status,
      message: text(get(err, "message")) || "the server answered " + status,
      field: text(get(err, "field")) || null};
  }

  async function loadModels() {
    let response;
    try {
      response = await fetch("/v1/models", {headers: headers(false), cache: "no-store"});
    } catch (e) {
      $("model-status").textContent = "The server cannot be reached; retrying…";
      setTimeout(loadModels, 2000);
      return;
    }
    const {node} = await readBody(response);
    if (response.status === 401) { askKey(apiError(node, 401).message); return; }
    if (response.status === 503) {
      const err = apiError(node, 503);
      $("model-status").textContent = err.code === "loading" || err.code === "model_loading"
        ? "The model is loading…" : "The model is not ready (" + err.message + "); retrying…";
      setTimeout(loadModels, 1000);
      return;
    }
    if (!response.ok) { $("model-status").textContent = "GET /v1/models: " + apiError(node, response.status).message; return; }
    $("key-form").hidden = true;
    const list = (get(node, "models") || {v: []}).v;
    const listed = get(node, "limits");
    if (num(get(listed, "max_body_bytes")) > 0) limits.body = num(get(listed, "max_body_bytes"));
    if (num(get(listed, "max_images")) > 0) limits.images = num(get(listed, "max_images"));
    showModels(list);
  }

  // Several models (a base and its fine-tunes): a picker, the default preselected and a choice
  // already made kept across a reload of the list. One model: no picker, and no "model" is sent.
  function showModels(list) {
    const picker = $("model-picker");
    const before = picker.value;
    modelList = list;
    models = list.map((m) => text(get(m, "name")) || "");
    const marked = list.find((m) => (get(m, "default") || {}).v === true);
    defaultModel = marked ? text(get(marked, "name")) : models[0];
    picker.replaceChildren(...list.map((m, i) => el("option", {value: models[i],
      text: models[i] + (models[i] === defaultModel ? " (default)" : get(m, "fine_tune") ? " (fine-tune)" : "")})));
    picker.value = models.includes(before) && before ? before : defaultModel;
    $("model-picker-row").hidden = models.length < 2;
    picker.onchange = () => { setError("model-error", ""); showModel(); };
    showModel();
    $("model-details").hidden = !list.length;
    renderHistory();
  }

  // The chosen model's facts under the picker (the only one's, without a picker).
  function showModel() {
    const m = modelList[Math.max(0, models.indexOf($("model-picker").value))];
    $("model-name").textContent = text(get(m, "name")) || "";
    const info = $("model-info");
    info.replaceChildren();
    for (const [k, v] of (m && m.k === "o" ? m.e : [])) {
      if (k === "files" && v.k === "o") {
        for (const [file, hash] of v.e) {
          info.append(el("dt", {text: "sha256 " + file}), el("dd", {class: "hash", text: hash.k === "s" ? hash.v : "unknown"}));
        }
      } else {
        info.append(el("dt", {text: k}), el("dd", {text: v.k === "s" ? v.v : dump(v)}));
      }
    }
    const parts = ["quant", "backend", "precision"].map((k) => text(get(m, k)) || (get(m, k) ? dump(get(m, k)) : null))
      .filter((v, i, all) => v && all.indexOf(v) === i);
    $("model-status").textContent = "Model: " + (text(get(m, "name")) || "?") + (parts.length ? " · " + parts.join(" · ") : "");
  }

  function askKey(message) {
    $("model-status").textContent = "This server needs an API key.";
    $("key-form").hidden = false;
    $("key-error").textContent = sessionStorage.getItem(API_KEY) ? message : "";
    $("api-key").focus();
  }

  // Each finished attempt (answered, refused, or stopped at a field) counts on <body
  // data-decisions>: what a test or a script waits on.
  let attempts = 0;
  async function decide() {
    try {
      await decideOnce();
    } finally {
      document.body.dataset.decisions = String(++attempts);
    }
  }

  async function decideOnce() {
    let request;
    try {
      request = buildRequest();
    } catch (e) {
      if (e instanceof FieldError) { focusError(e.message); return; }
      throw e;
    }
    const body = dump(request);
    const size = new Blob([body]).size;
    if (size > limits.body) {  // as the server refuses it (clef_gguf/server/http.py read_json)
      setError(pictures.length ? "images-error" : "request-error",
        "the body is " + size + " bytes; the limit is " + limits.body +
        ": too many tokens for one request (body_too_large)");
      if (pictures.length) focusError("images");
      return;
    }
    const button = $("decide");
    button.disabled = true;
    $("answers-status").textContent = "Deciding…";
    const started = performance.now();
    let response;
    try {
      response = await fetch("/v1/systemone", {method: "POST", headers: headers(true), body, cache: "no-store"});
    } catch (e) {
      button.disabled = false;
      $("answers-status").textContent = "No answer.";
      setError("request-error", "The server cannot be reached: " + e.message);
      return;
    }
    const latency = performance.now() - started;
    const {node} = await readBody(response);
    button.disabled = false;
    if (!response.ok || !node) {
      $("answers-status").textContent = "The request was refused.";
      if (response.status === 401) askKey(apiError(node, 401).message);
      showApiError(apiError(node, response.status), request);
      return;
    }
    lastResult = {request: body, node: request, pictures: pictures.length, response: node, latency,
      timing: response.headers.get("Server-Timing") || "", model: text(get(node, "model")) || "",
      at: new Date().toISOString()};
    showResult(lastResult);
    remember(lastResult);
    $("pin-baseline").disabled = false;
  }

  // An API error goes next to the control its `field` names; anything else under Decide.
  function showApiError(err, request) {
    const message = err.message + " (" + err.code + (err.field ? ", field " + err.field : "") + ")";
    const f = err.field || "";
    if (f === "state" || f.startsWith("state.")) { setError("state-error", message); focusError("state"); return; }
    if (f === "options" || f.startsWith("options.") || f === "truncate_state" || f === "strict") {
      setError("options-error", message); return;
    }
    if (f === "model") { setError("model-error", message); return; }
    const media = (name) => f === name || f.startsWith(name + ".");
    if (media("images") || media("videos") || media("media_kwargs") ||
        (!f && pictures.length && ["body_too_large", "media_too_large"].includes(err.code))) {
      setError("images-error", message);
      focusError("images");
      return;
    }
    if (f === "questions" || f.startsWith("questions.")) {
      const ids = (get(request, "questions") || {e: []}).e.map((e) => e[0])
        .filter((id) => f === "questions." + id || f.startsWith("questions." + id + "."))
        .sort((a, b) => b.length - a.length);
      if (ids.length && questionError(ids[0], message, formView())) return;
      if (!formView()) { setError("questions-json-error", message); focusError("questions-json"); return; }
      setError("questions-error", message);
      return;
    }
    setError("request-error", message);
  }

  function questionError(id, message, inForm) {
    if (!inForm) return false;
    const index = questions.findIndex((q) => q.id === id);
    if (index < 0) return false;
    const card = $("questions-form").children[index];
    if (!card) return false;
    card.querySelector("[data-error=question]").textContent = message;
    const idInput = card.querySelector("input.qid");
    idInput.setAttribute("aria-invalid", "true");
    idInput.focus();
    return true;
  }

  function focusError(what) {
    const target = {state: "state", "questions-json": "questions-json", images: "images-input"}[what];
    if (target) $(target).focus();
  }

  // ------------------------------------------------------------------ answers
  function answerRows(answer) {
    // -> {rows: [{id, label, p}], chosen, confidence, score, levels}
    const type = text(get(answer, "type"));
    if (type === "noul") {
      const p = num(get(answer, "noul"));
      const q = Number((1 - p).toFixed(4));
      return {type, rows: [{id: "true", label: "true (yes)", p}, {id: "false", label: "false (no)", p: q}],
        chosen: p >= 0.5 ? "true" : "false", confidence: Math.max(p, q)};
    }
    const probs = get(answer, "probabilities") || {e: []};
    const legend = get(answer, "legend");
    const rows = probs.e.map(([id, p]) => {
      const desc = get(legend, id);
      return {id, label: desc ? id + " · " + (desc.k === "s" ? desc.v : dump(desc)) : id, p: num(p)};
    });
    if (type === "choice") {
      return {type, rows, chosen: text(get(answer, "choice")), confidence: num(get(answer, "confidence"))};
    }
    const top = rows.reduce((a, b) => (b.p > a.p ? b : a), rows[0] || {id: null});
    return {type, rows, chosen: top.id, confidence: num(get(answer, "confidence")),
      score: num(get(answer, "score")), levels: rows.length};
  }

  function showResult(result) {
    const results = $("results");
    results.replaceChildren();
    const answers = get(result.response, "answers") || {e: []};
    const base = baseline && get(baseline.response, "answers");
    for (const [qid, answer] of answers.e) {
      const a = answerRows(answer);
      const b = base && get(base, qid) ? answerRows(get(base, qid)) : null;
      const section = el("section", {class: "answer", dataset: {qid}, "aria-label": "Answer to " + qid});
      const heading = el("h3", {}, el("span", {class: "qid", text: qid}), el("span", {class: "type", text: " " + a.type}));
      section.append(heading);
      const summary = el("p", {class: "summary"});
      if (a.type === "score") {
        summary.append("Expected level ", el("strong", {class: "score", text: fmt(a.score)}),
          " on 0–" + (a.levels - 1) + " · most likely ", el("strong", {text: a.chosen}));
      } else {
        summary.append("Answer ", el("strong", {class: "chosen-id", text: a.chosen}));
      }
      summary.append(" · confidence ", el("span", {class: "confidence", text: fmt(a.confidence)}));
      section.append(summary);
      if (a.type === "score" && a.levels > 1) section.append(scale(a, b));
      const table = el("div", {class: "bars" + (b ? " compare" : ""), role: "list"});
      if (b) {
        table.append(el("div", {class: "bar-row head", "aria-hidden": "true"},
          el("span", {text: "option"}), el("span", {class: "span2", text: "now"}),
          el("span", {class: "span2", text: "baseline"}), el("span", {class: "bar-delta", text: "change"})));
      }
      for (const row of a.rows) {
        const before = b ? b.rows.find((r) => r.id === row.id) : null;
        table.append(barRow(row, row.id === a.chosen, before, !!b));
      }
      section.append(table);
      results.append(section);
    }
    showEvidence(result);
    const usage = get(result.response, "usage");
    $("tokens").textContent = dump(get(usage, "input_tokens") || {k: "z"});
    $("cached").textContent = dump(get(usage, "cached_tokens") || {k: "z"});
    $("latency").textContent = result.latency.toFixed(1) + " ms (in the browser)";
    const stages = result.timing.split(",").map((part) => /^\s*([\w-]+);dur=([\d.]+)/.exec(part)).filter(Boolean)
      .map((m) => [m[1], Number(m[2]).toFixed(1) + " ms"]);
    $("server-timing").textContent = stages.map((s) => s[0] + " " + s[1]).join(", ") || "—";
    // with pictures: how many, their tokens the vision tower did not run for, and its time, where
    // the response and the Server-Timing header carry them (their tokens are in input_tokens)
    $("pictures-row").hidden = !result.pictures;
    $("pictures-used").textContent = String(result.pictures || 0) + " (their tokens are counted in the input tokens)";
    const cachedMedia = get(usage, "cached_media_tokens");
    $("cached-media-row").hidden = !cachedMedia || cachedMedia.k === "z";
    $("cached-media").textContent = cachedMedia ? dump(cachedMedia) : "";
    const vision = stages.find((s) => s[0] === "vision");
    $("vision-row").hidden = !vision;
    $("vision-time").textContent = vision ? vision[1] : "";
    $("usage").hidden = false;
    const warnings = $("warnings");
    warnings.replaceChildren(...((get(result.response, "warnings") || {v: []}).v || []).map((w) =>
      el("li", {text: "Warning: " + (text(get(w, "message")) || dump(w))})));
    $("answers-status").textContent = "Answered by " + (result.model || "the model") +
      (baseline ? "; compared with the baseline (" + baseline.label + ")" : "");
  }

  // The evidence block (asked for with "evidence"): the selected question's spans over the state.
  function showEvidence(result) {
    const node = get(result.response, "evidence");
    $("evidence").hidden = !node;
    if (!node) return;
    const evidence = JSON.parse(dump(node));
    const state = result.node ? get(result.node, "state") : undefined;
    const stateText = state ? window.clefEvidence.render(state) : "";
    const picker = $("evidence-question");
    const qids = ((get(result.response, "answers") || {e: []}).e).map(([qid]) => qid);
    const keep = qids.includes(picker.value) ? picker.value : qids[0];
    picker.replaceChildren(...qids.map((qid) => el("option", {value: qid, text: qid})));
    picker.value = keep;
    picker.onchange = () => window.clefEvidence.show($("evidence-view"), stateText, evidence, picker.value);
    picker.onchange();
  }

  function scale(a, b) {
    const track = el("div", {class: "scale", role: "img",
      "aria-label": "expected level " + fmt(a.score) + " on a scale from 0 to " + (a.levels - 1)});
    const marker = el("span", {class: "scale-marker"});
    marker.style.left = (100 * a.score / (a.levels - 1)) + "%";
    track.append(marker);
    if (b && Number.isFinite(b.score)) {
      const old = el("span", {class: "scale-marker baseline"});
      old.style.left = (100 * b.score / (b.levels - 1)) + "%";
      track.append(old);
    }
    return track;
  }

  function barRow(row, chosen, before, comparing) {
    const fill = el("span", {class: "bar-fill"});
    fill.style.width = (row.p * 100) + "%";
    const line = el("div", {class: "bar-row" + (chosen ? " chosen" : ""), role: "listitem",
      dataset: {option: row.id}},
    el("span", {class: "bar-label"}, el("span", {class: "mark", text: chosen ? "✓ " : ""}),
      el("span", {class: "option-label", text: row.label}),
      chosen ? el("span", {class: "visually-hidden", text: " (chosen)"}) : null),
    el("span", {class: "bar-track", "aria-hidden": "true"}, fill),
    el("span", {class: "bar-value", text: fmt(row.p)}));
    if (comparing) {
      const old = el("span", {class: "bar-fill baseline"});
      old.style.width = (before ? before.p * 100 : 0) + "%";
      const delta = before ? row.p - before.p : NaN;
      line.append(el("span", {class: "bar-track", "aria-hidden": "true"}, old),
        el("span", {class: "bar-value baseline-value", text: before ? fmt(before.p) : "—"}),
        el("span", {class: "bar-delta" + (delta > 0 ? " up" : delta < 0 ? " down" : ""),
          text: before ? (delta > 0 ? "+" : delta < 0 ? "−" : "") + Math.abs(delta).toFixed(4) : "new"}));
    }
    return line;
  }

  // ------------------------------------------------------------------ history and baseline
  function history() {
    try { return JSON.parse(localStorage.getItem(HISTORY_KEY) || "[]"); } catch (e) { return []; }
  }

  function summarize(result) {
    const answers = get(result.response, "answers") || {e: []};
    return answers.e.map(([qid, a]) => {
      const r = answerRows(a);
      return qid + ": " + (r.type === "score" ? fmt(r.score) : r.chosen);
    }).join(", ");
  }

  function remember(result) {
    const state = get(result.node, "state");
    let request = result.request;
    let dropped = 0;
    if (request.length > HISTORY_REQUEST_MAX && get(result.node, "images")) {  // local storage is small
      dropped = get(result.node, "images").v.length;
      request = dump(obj(result.node.e.filter((e) => e[0] !== "images")));
    }
    const items = history();
    items.unshift({at: result.at, model: result.model, request, summary: summarize(result),
      pictures: result.pictures || 0, dropped,
      state: (state && state.k === "s" ? state.v : dump(state || {k: "z"})).slice(0, 80)});
    try { localStorage.setItem(HISTORY_KEY, JSON.stringify(items.slice(0, HISTORY_MAX))); } catch (e) { /* full: keep the page working */ }
    renderHistory();
  }

  function renderHistory() {
    const list = $("history");
    list.replaceChildren(...history().map((item, i) => el("li", {},
      el("span", {class: "when", text: new Date(item.at).toLocaleTimeString()}), " ",
      el("span", {class: "what", text: item.state + (item.pictures ? " [" + item.pictures +
        (item.pictures === 1 ? " picture" : " pictures") + "]" : "") + " → " + item.summary +
        (models.length > 1 && item.model ? " (" + item.model + ")" : "")}), " ",
      el("button", {type: "button", text: "Load", "aria-label": "Load run " + (i + 1),
        onclick: () => loadRequest(parseJson(item.request), item.dropped)}),
      el("button", {type: "button", text: "Run again", "aria-label": "Run again run " + (i + 1),
        onclick: () => { loadRequest(parseJson(item.request), item.dropped); decide(); }}))));
  }

  function pinBaseline() {
    if (!lastResult) return;
    baseline = Object.assign({label: (lastResult.model || "model") + ", " + new Date(lastResult.at).toLocaleTimeString()}, lastResult);
    $("baseline-status").textContent = "Baseline kept: " + baseline.label + ". Change the request or the model and Decide to compare.";
    $("baseline-status").hidden = false;
    $("clear-baseline").hidden = false;
    showResult(lastResult);
  }

  function dropBaseline() {
    baseline = null;
    $("baseline-status").hidden = true;
    $("clear-baseline").hidden = true;
    if (lastResult) showResult(lastResult);
    $("pin-baseline").focus();
  }

  // ------------------------------------------------------------------ copy as
  function copyAs(kind) {
    let request;
    try { request = buildRequest(); } catch (e) {
      if (e instanceof FieldError) { focusError(e.message); return; }
      throw e;
    }
    const base = location.origin;
    const keyed = !!sessionStorage.getItem(API_KEY);
    const compact = dump(request);
    const py = 'request = json.loads(r"""' + dump(request, 2) + '""")\n';
    let out;
    if (kind === "curl") {
      out = "curl -s " + base + "/v1/systemone -H 'Content-Type: application/json' " +
        (keyed ? "-H \"Authorization: Bearer $CLEF_GGUF_API_KEY\" " : "") +
        // pictures make a long body: from stdin (a here-document), not one argument (128 KiB at most)
        (get(request, "images") ? "--data-binary @- <<'JSON'\n" + compact + "\nJSON\n"
          : "-d '" + compact.replace(/'/g, "'\\''") + "'");
    } else if (kind === "python") {
      // the base (the entry that is no fine-tune), with the chosen fine-tune's directory
      const base = modelList.find((m) => !get(m, "fine_tune"));
      const name = (base && text(get(base, "name"))) || models[0] || "./model";
      const picked = text(get(request, "model"));
      const dir = text(get(get(modelList[models.indexOf(picked)], "fine_tune"), "directory"));
      const adapters = dir ? ", adapters={" + JSON.stringify(picked) + ": " + JSON.stringify(dir) + "}" : "";
      out = "import json\n\nfrom clef_gguf import Clef\n\n" + py +
        "with Clef.load(" + JSON.stringify(name) + adapters + ") as clef:  # a model directory or catalog name\n" +
        "    print(json.dumps(clef.decide(request), indent=2))\n";
    } else if (kind === "avrik") {
      const extras = ["model", "options"].filter((k) => get(request, k)).map((k) => ", " + k + '=request["' + k + '"]').join("") +
        // avrik-sdk takes pictures as image() objects: {"data": base64, "media_type"}
        (get(request, "images") ? ', images=[{"data": u.split(",", 1)[1], "media_type": u[5:u.index(";")]} for u in request["images"]]' : "");
      out = "import json\n" + (keyed ? "import os\n" : "") + "\nfrom avrik_sdk import Client\n\n" + py +
        "with Client(" + JSON.stringify(base) + (keyed ? ', api_key=os.environ["CLEF_GGUF_API_KEY"]' : "") + ") as client:\n" +
        '    decision = client.decide(request["state"], request["questions"]' + extras + ")\n" +
        "    print(decision.model_dump_json(indent=2, exclude_none=True, exclude_defaults=True))\n";
    } else {
      out = dump(request, 2);
    }
    const pre = $("copy-output");
    pre.textContent = out;
    pre.hidden = false;
    pre.dataset.kind = kind;
    const status = $("copy-status");
    const done = (ok) => { status.textContent = ok ? "Copied to the clipboard." : "Select the text above to copy it."; };
    if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(out).then(() => done(true), () => done(false));
    else done(false);
  }

  // ------------------------------------------------------------------ examples
  const EXAMPLES = [
    {name: "Support ticket routing", state: "Hi, I was charged twice for order 1182 and nobody answers my emails. " +
      "This is the third time I write. Fix it today or I cancel.", questions: [
      ["urgent", {type: "noul", instructions: "Does this need an answer today?"}],
      ["team", {type: "choice", instructions: "Which team should handle it?",
        options: [["billing", "Payments, refunds, invoices"], ["tech", "Bugs and outages"], ["sales", "New deals"]]}],
      ["anger", {type: "score", instructions: "How angry is the customer?", levels: ["calm", "annoyed", "furious"]}]]},
    {name: "Invoice follow-up", state: "Invoice INV-7 for $1,250.00 is 40 days past due.", questions: [
      ["overdue", {type: "noul", instructions: "Is the invoice overdue?"}],
      ["action", {type: "choice", instructions: "Next step?",
        options: [["remind", "Send a reminder"], ["escalate", "Escalate to collections"]]}],
      ["risk", {type: "score", instructions: "Risk of non-payment", levels: ["low", "medium", "high"]}]]},
    {name: "Content moderation", state: "Check out my new blog post about gardening tips!", questions: [
      ["spam", {type: "noul", instructions: "Is this message spam?"}],
      ["topic", {type: "choice", instructions: "Topic",
        options: [["hobby", null], ["politics", null], ["commerce", "Selling something"]]}],
      ["toxicity", {type: "score", instructions: "How toxic is it?", levels: ["none", "mild", "strong", "severe"]}]]},
  ];

  function loadExample(index) {
    const ex = EXAMPLES[index];
    $("state-mode-text").checked = true;
    $("state").value = ex.state;
    questions = ex.questions.map(([id, spec]) => {
      const q = newQuestion(spec.type);
      q.id = id;
      q.instructions = S(spec.instructions);
      if (spec.options) q.options = spec.options.map(([o, d]) => ({id: o, desc: d === null ? null : S(d)}));
      if (spec.levels) q.levels = spec.levels.map(S);
      return q;
    });
    if (formView()) renderQuestions(); else showQuestionsJson();
    clearErrors();
  }

  // ------------------------------------------------------------------ wiring
  function start() {
    $("examples").replaceChildren(...EXAMPLES.map((ex, i) => el("option", {value: String(i), text: ex.name})));
    $("example-load").addEventListener("click", () => loadExample(Number($("examples").value)));
    $("add-noul").addEventListener("click", () => addQuestion("noul"));
    $("add-choice").addEventListener("click", () => addQuestion("choice"));
    $("add-score").addEventListener("click", () => addQuestion("score"));
    $("state").addEventListener("input", checkState);
    $("state-mode-text").addEventListener("change", checkState);
    $("state-mode-json").addEventListener("change", checkState);
    $("questions-view-json").addEventListener("change", showQuestionsJson);
    $("questions-view-form").addEventListener("change", showQuestionsForm);
    $("questions-json").addEventListener("input", readQuestionsJson);
    $("decide").addEventListener("click", decide);
    $("images-input").addEventListener("change", (ev) => {
      addPictures(ev.target.files).then(() => { ev.target.value = ""; });  // the same file may be picked again
    });
    const hasFiles = (ev) => !!ev.dataTransfer && Array.from(ev.dataTransfer.types || []).includes("Files");
    document.addEventListener("dragover", (ev) => {
      if (!hasFiles(ev)) return;
      ev.preventDefault();
      ev.dataTransfer.dropEffect = "copy";
      document.body.classList.add("dragging");
    });
    document.addEventListener("dragleave", (ev) => { if (!ev.relatedTarget) document.body.classList.remove("dragging"); });
    document.addEventListener("drop", (ev) => {
      document.body.classList.remove("dragging");
      if (!hasFiles(ev)) return;
      ev.preventDefault();  // the browser would open the file instead
      addPictures(ev.dataTransfer.files);
    });
    document.addEventListener("paste", (ev) => {  // a picture in the clipboard; text pastes as usual
      const files = Array.from((ev.clipboardData && ev.clipboardData.files) || []);
      if (!files.length) return;
      ev.preventDefault();
      addPictures(files);
    });
    $("pin-baseline").addEventListener("click", pinBaseline);
    $("clear-baseline").addEventListener("click", dropBaseline);
    $("history-clear").addEventListener("click", () => { localStorage.removeItem(HISTORY_KEY); renderHistory(); });
    for (const kind of ["curl", "python", "avrik", "json"]) {
      $("copy-" + kind).addEventListener("click", () => copyAs(kind));
    }
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const key = $("api-key").value.trim();
      if (!key) { $("key-error").textContent = "Enter the key the server was started with."; return; }
      sessionStorage.setItem(API_KEY, key);
      $("api-key").value = "";
      $("key-error").textContent = "";
      loadModels();
    });
    document.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); decide(); }
    });
    loadExample(0);
    renderHistory();
    loadModels();
  }

  start();
})();
