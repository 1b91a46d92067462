// The evidence view of the playground: the state as the prompt held it, with the spans the selected
// question's attention rested on highlighted (their share, and Δp when occlusion ran). Text reaches
// the page only through textContent. Used by app.js as window.clefEvidence.
"use strict";

(function () {
  // Python's repr of a float (the server renders a JSON state with it): shortest digits, fixed
  // notation for exponents -4..15, else d.ddde±XX.
  function pyFloat(x) {
    if (!Number.isFinite(x)) return String(x);
    const [mantissa, exp] = x.toExponential().split("e");
    const e = Number(exp);
    const sign = mantissa.startsWith("-") ? "-" : "";
    const digits = mantissa.replace("-", "").replace(".", "");
    if (e >= -4 && e < 16) {
      if (e < 0) return sign + "0." + "0".repeat(-e - 1) + digits;
      const whole = digits.length > e + 1 ? digits.slice(0, e + 1) : digits + "0".repeat(e + 1 - digits.length);
      const frac = digits.slice(e + 1);
      return sign + whole + "." + (frac || "0");
    }
    const m = digits.length > 1 ? digits[0] + "." + digits.slice(1) : digits;
    return sign + m + "e" + (e < 0 ? "-" : "+") + String(Math.abs(e)).padStart(2, "0");
  }

  // The state as the server renders it (pipeline/encode.py render): a string raw, any other value as
  // compact JSON with sorted keys. An ordered-JSON node of app.js ({k, v | e}).
  function render(node, top) {
    switch (node.k) {
      case "s": return top ? node.v : JSON.stringify(node.v);
      case "o": return "{" + node.e.slice().sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
        .map(([key, v]) => JSON.stringify(key) + ":" + render(v, false)).join(",") + "}";
      case "a": return "[" + node.v.map((v) => render(v, false)).join(",") + "]";
      case "n": return /^-?\d+$/.test(node.v) ? String(BigInt(node.v)) : pyFloat(Number(node.v));
      case "b": return node.v ? "true" : "false";
      default: return "null";
    }
  }

  const pct = (x) => (100 * x).toFixed(1) + "%";

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // A picture's patch grid (row by row, as the API gives it) as a small heat map: each cell's colour
  // scaled to the picture's strongest patch, so that where it looked shows even when its share is small.
  function heatMap(picture, number) {
    const most = Math.max(...picture.grid.flat(), 1e-12);
    const figure = el("figure", {class: "evidence-heatmap"});
    const cells = el("div", {class: "evidence-grid", role: "img",
      "aria-label": "Picture #" + number + ": attention over its " + picture.rows + " × " + picture.cols + " patches"});
    cells.style.setProperty("--cols", String(picture.cols));
    picture.grid.forEach((row, r) => row.forEach((x, c) => {
      const cell = el("span", {title: "row " + (r + 1) + ", column " + (c + 1) + ": " + pct(x)});
      cell.style.setProperty("--heat", String(x / most));
      cells.append(cell);
    }));
    figure.append(cells, el("figcaption", {}, "#" + number + " " + pct(picture.share)));
    return figure;
  }

  // evidence: the response's "evidence" block as plain JSON; stateText: the rendered state.
  function show(container, stateText, evidence, qid) {
    container.replaceChildren();
    const block = evidence.questions[qid];
    if (!block) return;
    const shares = Object.entries(block.shares).map(([k, v]) => k + " " + pct(v)).join(" · ");
    container.append(el("p", {class: "evidence-shares"}, "Attention of “" + block.option + "”: " + shares));
    const placed = block.spans.map((s, i) => ({...s, rank: i + 1}))
      .filter((s) => stateText.slice(s.start, s.end) === s.text).sort((a, b) => a.start - b.start);
    const text = el("p", {class: "evidence-state", "aria-label": "The state with the spans highlighted"});
    let at = 0;
    for (const s of placed) {
      if (s.start < at) continue;
      text.append(stateText.slice(at, s.start));
      const mark = el("mark", {"data-rank": String(s.rank), title: pct(s.share) + " of the state's attention"}, s.text);
      mark.style.setProperty("--share", String(Math.min(1, s.share * 2 + 0.15)));
      text.append(mark);
      at = s.end;
    }
    text.append(stateText.slice(at));
    container.append(text);
    const list = el("ol", {class: "evidence-spans"});
    for (const s of block.spans) {
      let line = "“" + s.text + "” " + pct(s.share) + (s.path ? " at " + s.path : "");
      if (s.delta_p !== undefined) {
        line += " · without it Δp " + (s.delta_p >= 0 ? "+" : "−") + Math.abs(s.delta_p).toFixed(4);
        if (s.top_option !== undefined) line += " → " + s.top_option;
      }
      list.append(el("li", {"data-start": String(s.start)}, line));
    }
    container.append(list);
    if (block.pictures) {
      container.append(el("p", {class: "evidence-pictures"},
        "Pictures: " + block.pictures.map((p, i) => "#" + (i + 1) + " " + pct(p.share)).join(", ")));
      const maps = block.pictures.map((p, i) => p.grid && heatMap(p, i + 1)).filter(Boolean);
      if (maps.length) {
        const row = el("div", {class: "evidence-heatmaps"});
        row.append(...maps);
        container.append(row);
      }
    }
    if (evidence.reruns !== undefined) {
      container.append(el("p", {class: "hint"}, "Occlusion: " + evidence.reruns + " re-runs, one per span without it."));
    }
  }

  window.clefEvidence = {render: (node) => render(node, true), show, pyFloat};
})();
