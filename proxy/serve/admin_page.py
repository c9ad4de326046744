"""The admin page at `/`: recent records live, filters as the API's, one record in full, and the
live verdict of the last hour. Plain HTML and a little JavaScript, served by the proxy: no build
step and nothing loaded from anywhere else, so it works offline.

The page holds no data itself: it reads `/api/requests` and `/api/diagnose` from the same origin.
Filters (the API's, the proxy instance and the upstream among them) live in the URL's fragment
(`/#stop_reason=length&instance=pod-3:8080`), so a view can be linked;
`record=<id>` there opens that record in full.
"""

from __future__ import annotations

import html

import orjson

STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 20px; margin: 0 0 .5em; } h2 { font-size: 16px; margin: 1.2em 0 .4em; }
form { display: flex; flex-wrap: wrap; gap: .6em; align-items: end; margin-bottom: .8em; }
label { display: flex; flex-direction: column; font-size: 12px; color: #555; }
table { border-collapse: collapse; font-size: 13px; width: 100%; }
th, td { border-bottom: 1px solid #ddd; padding: 3px 6px; text-align: left; white-space: nowrap; }
tbody tr { cursor: pointer; } tbody tr:hover { background: #f3f6fa; }
td.num { text-align: right; } .cut { color: #b00020; font-weight: 600; } .budget { color: #8a6d00; }
#detail { background: #fafafa; border: 1px solid #ddd; padding: .6em; max-height: 28em; overflow: auto; }
.verdict { border-left: 5px solid #d62728; background: #fafafa; padding: .4em .8em; margin: .5em 0; }
.verdict.no_load_effect, .verdict.insufficient_data { border-left-color: #2ca02c; }
.muted { color: #777; font-size: 12px; }
"""

SCRIPT = """
const CHOICES = JSON.parse(document.getElementById('choices').textContent);
const FIELDS = ['stop_reason', 'cause', 'outcome', 'concurrency', 'model', 'route', 'instance', 'upstream',
  'client', 'since'];
const form = document.getElementById('filters');
function fill(name, values) {
  const select = form.elements[name];
  for (const value of values) { const o = document.createElement('option'); o.value = o.textContent = value;
    select.appendChild(o); }
}
fill('stop_reason', CHOICES.stop_reason); fill('cause', CHOICES.cause); fill('outcome', CHOICES.outcome);
fill('concurrency', CHOICES.concurrency);
function state() { return new URLSearchParams(location.hash.slice(1)); }
function load() { const s = state(); for (const f of FIELDS) form.elements[f].value = s.get(f) || ''; }
form.addEventListener('change', () => {
  const s = new URLSearchParams();
  for (const f of FIELDS) if (form.elements[f].value) s.set(f, form.elements[f].value);
  location.hash = s.toString();
});
window.addEventListener('hashchange', () => { load(); refresh(); });
function cell(row, text, cls) { const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; }
function ms(s) { return s == null ? '-' : (s * 1000).toFixed(0) + ' ms'; }
async function refresh() {
  const s = state(); const q = new URLSearchParams({limit: '200'});
  for (const f of FIELDS) if (s.get(f) && f !== 'since') q.set(f, s.get(f));
  if (s.get('since')) q.set('since', String(Date.now() / 1000 - Number(s.get('since'))));
  const response = await fetch('api/requests?' + q);
  const status = document.getElementById('status');
  if (!response.ok) { status.textContent = 'the admin API answered HTTP ' + response.status; return; }
  const page = await response.json();
  const body = document.querySelector('#records tbody'); body.replaceChildren();
  for (const r of page.records) {
    const row = body.insertRow(); row.dataset.id = r.request_id;
    cell(row, new Date(r.started_at * 1000).toLocaleTimeString());
    cell(row, r.instance || '-', 'muted'); cell(row, r.client || '-', 'muted'); cell(row, r.model || '-');
    cell(row, r.route);
    cell(row, r.stop_reason, r.outcome === 'cut' ? 'cut' : r.outcome === 'budget' ? 'budget' : '');
    cell(row, r.cause);
    cell(row, (r.output_tokens ?? '-') + ' / ' + (r.requested_max_tokens ?? '-'), 'num');
    cell(row, r.concurrency_peak, 'num'); cell(row, ms(r.ttft_s), 'num'); cell(row, r.request_id, 'muted');
    row.addEventListener('click', () => { const s = state(); s.set('record', r.request_id);
      history.replaceState(null, '', '#' + s); show(r.request_id); });
  }
  status.textContent = page.records.length + ' records (' + page.source + '), updated ' +
    new Date().toLocaleTimeString();
}
async function show(id) {
  const response = await fetch('api/requests/' + encodeURIComponent(id));
  document.getElementById('detail').textContent = JSON.stringify(await response.json(), null, 2);
}
function chart(levels) {
  const step = 70, h = 120, ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('width', step * levels.length + 20); svg.setAttribute('height', h + 36);
  svg.setAttribute('class', 'completion-chart');
  svg.setAttribute('aria-label', 'share of answers complete, by concurrency');
  const text = (x, y, value) => { const t = document.createElementNS(ns, 'text'); t.setAttribute('x', x);
    t.setAttribute('y', y); t.setAttribute('font-size', '11'); t.setAttribute('text-anchor', 'middle');
    t.textContent = value; return t; };
  levels.forEach((l, i) => {
    const bar = document.createElementNS(ns, 'rect'), x = 10 + i * step;
    bar.setAttribute('x', x + 10); bar.setAttribute('y', h - l.completion_rate * h); bar.setAttribute('width', 40);
    bar.setAttribute('height', Math.max(1, l.completion_rate * h)); bar.setAttribute('fill', '#4c78a8');
    const title = document.createElementNS(ns, 'title');
    title.textContent = 'concurrency ' + l.level + ': ' + l.n + ' answers, median ' +
      l.output_tokens_median + ' tokens';
    bar.appendChild(title);
    const share = Math.round(l.completion_rate * 100) + '%';
    svg.append(bar, text(x + 30, h + 14, 'c=' + l.level), text(x + 30, h + 28, share));
  });
  return svg;
}
async function verdict() {
  const box = document.getElementById('verdict');
  const response = await fetch('api/diagnose?since=3600');
  if (!response.ok) { box.textContent = 'no verdict: HTTP ' + response.status; return; }
  const found = await response.json(); box.replaceChildren();
  for (const t of found.timeouts || []) {
    const div = document.createElement('div'); div.className = 'verdict timeout';
    const head = document.createElement('strong'); head.textContent = 'A timeout in the path (' + t.side + ' side)';
    const text = document.createElement('p'); text.textContent = t.text; div.append(head, text); box.appendChild(div);
  }
  const whose = () => { for (const line of found.whose || []) {
    const p = document.createElement('p'); p.className = 'muted whose'; p.textContent = line; box.appendChild(p);
  } };
  if (!found.groups.length) {
    const p = document.createElement('p'); p.textContent = found.note; box.appendChild(p); whose(); return;
  }
  // The API lists the verdicts that need action first: a serving defect before a calm model.
  for (const g of found.groups) {
    const div = document.createElement('div'); div.className = 'verdict ' + g.verdict.kind;
    const head = document.createElement('strong');
    head.textContent = 'Verdict: ' + g.verdict.kind.replace(/_/g, ' ') + ' (' + g.name + ', ' + g.n + ' answers)';
    const text = document.createElement('p'); text.textContent = g.verdict.headline;
    const note = document.createElement('p'); note.className = 'muted'; note.textContent = found.observational;
    const caption = document.createElement('p'); caption.className = 'muted';
    caption.textContent = 'answers that ended on their own, by the concurrency they saw:';
    div.append(head, text, caption, chart(g.levels));
    if ((g.levels_left_out || []).length) {
      const left = document.createElement('p'); left.className = 'muted thin-levels';
      left.textContent = 'left out for too few records: ' +
        g.levels_left_out.map(l => 'c=' + l.level + ' (' + l.n + (l.n === 1 ? ' record)' : ' records)')).join(', ');
      div.append(left);
    }
    div.append(note);
    if (g.sweep) {
      const c = document.createElement('p'); c.className = 'muted';
      c.textContent = 'To be sure it is the load, run the controlled sweep (the same request at each level):';
      const code = document.createElement('code'); code.textContent = g.sweep; div.append(c, code);
    }
    box.appendChild(div);
  }
  whose();
}
load(); refresh(); verdict();
if (state().get('record')) show(state().get('record'));
setInterval(refresh, 2000); setInterval(verdict, 15000);
"""


def render(choices: dict[str, list[str]]) -> bytes:
    """The page, with the filter choices the API accepts."""
    blob = html.escape(orjson.dumps(choices).decode(), quote=False)
    since = "".join(f'<option value="{seconds}">{label}</option>' for label, seconds in
                    (("15 min", 900), ("1 hour", 3600), ("6 hours", 21600), ("24 hours", 86400)))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>llm-diag-proxy: records</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head><body>
<h1>llm-diag-proxy: why did answers end?</h1>
<h2>Live verdict, last hour</h2><div id="verdict">loading the verdict...</div>
<h2>Recent records</h2>
<form id="filters">
<label>stop reason<select name="stop_reason"><option value="">any</option></select></label>
<label>cause<select name="cause"><option value="">any</option></select></label>
<label>outcome<select name="outcome"><option value="">any</option></select></label>
<label>concurrency<select name="concurrency"><option value="">any</option></select></label>
<label>model<input name="model" size="14"></label><label>route<input name="route" size="18"></label>
<label>instance<input name="instance" size="14"></label><label>upstream<input name="upstream" size="18"></label>
<label>client<input name="client" size="16"></label>
<label>since<select name="since"><option value="">any time</option>{since}</select></label>
</form>
<p id="status" class="muted">loading...</p>
<table id="records"><thead><tr><th>time</th><th>instance</th><th>client</th><th>model</th><th>route</th>
<th>stop reason</th><th>cause</th><th>output / requested</th><th>concurrency</th><th>TTFT</th><th>request id</th>
</tr></thead>
<tbody></tbody></table>
<h2>Record</h2><pre id="detail" class="muted">click a record to see it in full</pre>
<script type="application/json" id="choices">{blob}</script>
<script>{SCRIPT}</script>
</body></html>
""".encode()
