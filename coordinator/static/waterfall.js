// The last turn's waterfall, from the server event duplexq.turn.trace (sent while
// tracing is on: docs/tracing.md).
//
// One row per stage on the path to the answer's first audio: its wait (duplexq's own
// time: queues, Redis, fencing) then its work (the stage's model), placed on one time
// axis from the turn's end; a last row for the trip from the last stage to the page.
// Built with DOM nodes and textContent only: nothing from the server is parsed as HTML.

function bar(kind, fromMs, toMs, totalMs, label) {
  const el = document.createElement("span");
  el.className = `wf-bar wf-${kind}`;
  const span = Math.max(0, toMs - fromMs);
  el.style.left = `${totalMs ? (100 * fromMs) / totalMs : 0}%`;
  el.style.width = `${totalMs ? Math.max(0.5, (100 * span) / totalMs) : 0}%`;
  el.title = `${label}: ${span.toFixed(1)} ms`;
  return el;
}

function row(name, bars, note) {
  const li = document.createElement("li");
  li.className = "wf-row";
  const label = document.createElement("span");
  label.className = "wf-name";
  label.textContent = name;
  const track = document.createElement("span");
  track.className = "wf-track";
  for (const b of bars) track.append(b);
  const value = document.createElement("span");
  value.className = "wf-ms";
  value.textContent = note;
  li.append(label, track, value);
  return li;
}

/** Draw ``event`` (a duplexq.turn.trace) into ``container``, replacing what was there. */
export function renderWaterfall(container, event) {
  const total = Number(event.total_ms) || 0;
  const rows = [];
  let last = 0;
  for (const stage of event.stages || []) {
    const start = Number(stage.start_ms) || 0;
    const end = Number(stage.end_ms) || 0;
    const queued = Number(stage.queued_ms) || 0;
    rows.push(
      row(
        String(stage.stage),
        [
          bar("own", start - queued, start, total, "waiting (duplexq)"),
          bar("work", start, end, total, "working"),
        ],
        `${(Number(stage.work_ms) || 0).toFixed(0)} ms`,
      ),
    );
    last = end;
  }
  rows.push(
    row("to you", [bar("own", last, total, total, "delivery (duplexq)")],
        `${(Number(event.delivery_ms) || 0).toFixed(1)} ms`),
  );
  const summary = document.createElement("p");
  summary.className = "wf-summary";
  const share = (100 * (Number(event.own_share) || 0)).toFixed(1);
  summary.textContent =
    `turn end → first audio ${total.toFixed(0)} ms; duplexq's own ` +
    `${(Number(event.own_ms) || 0).toFixed(1)} ms (${share} %)`;
  const list = document.createElement("ol");
  list.className = "wf-rows";
  list.append(...rows);
  container.replaceChildren(summary, list);
  container.hidden = false;
}
