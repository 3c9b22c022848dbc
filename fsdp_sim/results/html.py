"""The HTML report: one self-contained file (no network at view time: styles, figures and script inline)
that a user attaches to a design review.

`run_report(result)`: the summary, the memory timeline (hover: time, allocated, reserved and each
category at the cursor), the streams' Gantt, the breakdown at the peak and the step's time breakdown.
`sweep_report(...)`: for `sweep` and `recommend`: the recommendation (if any), the Pareto front and
every row in a table that sorts by any column (click its header).

When its script has run the page sets `<body data-ready="1">`, and `data-errors` lists any script
error; `data-figures` gives each figure's drawn size: what the browser test (tests/test_html.py) reads.
"""

from __future__ import annotations

import json
from html import escape

from fsdp_sim.results import svg
from fsdp_sim.results.analysis import StepResult
from fsdp_sim.results.report import fault_words, fit_word, fmt_bytes, fmt_time, pricing_words, summary, tally

STYLE = """
body{font-family:sans-serif;margin:1.5em auto;max-width:1100px;color:#222}
pre{background:#f6f6f6;padding:.8em;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}
table{border-collapse:collapse;font-size:12px;margin:.5em 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#eee;cursor:pointer;user-select:none}
td:first-child,th:first-child{text-align:left}
tr.best td{background:#fff5c2}
tr.nofit td{color:#888}
.figure{border:1px solid #eee;margin:.3em 0}
#tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #888;padding:4px 6px;font-size:12px;
white-space:pre;display:none;box-shadow:2px 2px 4px #0002}
.legend span{margin-right:1.2em;font-size:12px;white-space:nowrap}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;border-radius:5px}
"""

SCRIPT = """
(function(){
  const errors=[];
  window.addEventListener('error',e=>{errors.push(String(e.message));document.body.dataset.errors=errors.join('; ');});
  const tip=document.getElementById('tip');
  const gib=b=>(b/1073741824).toFixed(2)+' GiB';
  const ms=s=>(s*1e3).toFixed(2)+' ms';
  const tl=document.getElementById('timeline');
  if(tl){
    const d=JSON.parse(tl.dataset.series), cursor=tl.querySelector('.cursor');
    tl.addEventListener('mousemove',ev=>{
      const p=tl.createSVGPoint(); p.x=ev.clientX; p.y=ev.clientY;
      const q=p.matrixTransform(tl.getScreenCTM().inverse());
      if(q.x<d.x0||q.x>d.x1){tip.style.display='none';cursor.setAttribute('visibility','hidden');return;}
      const t=(q.x-d.x0)/(d.x1-d.x0)*d.end;
      let lo=0,hi=d.t.length-1;
      while(lo<hi){const mid=(lo+hi+1)>>1; if(d.t[mid]<=t) lo=mid; else hi=mid-1;}
      let total=0; const parts=[];
      d.names.forEach((n,k)=>{const v=d.levels[k][lo]; total+=v; if(v>0) parts.push('  '+n+' '+gib(v));});
      tip.textContent='t = '+ms(t)+'\\nallocated '+gib(total)+'\\nreserved '+gib(d.reserved[lo])+'\\n'+parts.join('\\n');
      tip.style.display='block'; tip.style.left=(ev.clientX+14)+'px'; tip.style.top=(ev.clientY+10)+'px';
      cursor.setAttribute('x1',q.x); cursor.setAttribute('x2',q.x); cursor.setAttribute('visibility','visible');
    });
    tl.addEventListener('mouseleave',()=>{tip.style.display='none';cursor.setAttribute('visibility','hidden');});
  }
  document.querySelectorAll('table.sortable').forEach(table=>{
    table.querySelectorAll('th').forEach((th,col)=>{
      th.addEventListener('click',()=>{
        const body=table.tBodies[0], rows=Array.from(body.rows);
        const up=th.dataset.order!=='asc'; table.querySelectorAll('th').forEach(h=>delete h.dataset.order);
        th.dataset.order=up?'asc':'desc';
        const key=r=>{const c=r.cells[col]; const v=c.dataset.v!==undefined?c.dataset.v:c.textContent;
                      const n=parseFloat(v); return isNaN(n)?v:n;};
        rows.sort((a,b)=>{const x=key(a),y=key(b); const c=(typeof x==='number'&&typeof y==='number')?x-y:
                          String(x).localeCompare(String(y)); return up?c:-c;});
        rows.forEach(r=>body.appendChild(r));
      });
    });
  });
  const sizes={};
  document.querySelectorAll('svg.figure').forEach(f=>{const b=f.getBBox(); sizes[f.id]=[Math.round(b.width),
    Math.round(b.height), f.querySelectorAll('*').length];});
  document.body.dataset.figures=JSON.stringify(sizes);
  document.body.dataset.wide=String(Array.from(document.querySelectorAll('pre,h1,p'))
    .filter(e=>e.scrollWidth>e.clientWidth+1).length);  // text that would scroll sideways
  document.body.dataset.ready='1';
})();
"""


def _page(title: str, sections: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{escape(title)}</h1>" + "".join(sections)
            + f'<div id="tip"></div><script>{SCRIPT}</script></body></html>\n')


def _table(head: list[str], rows: list[list], classes: list[str] | None = None, sortable: bool = False) -> str:
    """Cells are (text, sort value) or text."""
    out = [f'<table{" class=sortable" if sortable else ""}><thead><tr>'
           + "".join(f"<th>{escape(h)}</th>" for h in head) + "</tr></thead><tbody>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        cells = []
        for cell in row:
            text, value = cell if isinstance(cell, tuple) else (cell, None)
            sort = f' data-v="{escape(str(value))}"' if value is not None else ""
            cells.append(f"<td{sort}>{escape(str(text))}</td>")
        out.append(f"<tr{cls}>" + "".join(cells) + "</tr>")
    return "".join(out) + "</tbody></table>"


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def run_report(result: StepResult, data: dict | None = None) -> str:
    """The report of one step (`data` is `result.to_dict()`, computed here when not given)."""
    d = data or result.to_dict()
    peak, mem, comp = d["peak"], d["memory"], d["compute"]
    cats = [[c, (fmt_bytes(v), v), _share(v, peak["allocated_bytes"])] for c, v in peak["by_category"].items() if v]
    cats.append(["peak allocated", (fmt_bytes(peak["allocated_bytes"]), peak["allocated_bytes"]), "100.0 %"])
    over = [[k.replace("_", " "), (fmt_bytes(v), v)] for k, v in mem["overheads_bytes"].items()]
    over.append(["required", (fmt_bytes(mem["required_bytes"]), mem["required_bytes"])])
    live = [[b["name"], b["category"], (fmt_bytes(b["bytes"]), b["bytes"])] for b in peak["live_buffers"]]
    times = [[k.removesuffix("_s").replace("_", " "), (fmt_time(v), v), _share(v, d["step_time_s"])]
             for k, v in comp["breakdown"].items()]
    times.append(["exposed communication", (fmt_time(d["communication"]["exposed_s"]), d["communication"]["exposed_s"]),
                  _share(d["communication"]["exposed_s"], d["step_time_s"])])
    p = d.get("per_rank")  # run --per-rank: the mean rank's, and its stall for the group's last rank beside them
    if p:
        stall = p["stalled_s"]["mean"]
        times.append(["stalled for the group's last rank", (fmt_time(stall), stall), _share(stall, d["step_time_s"])])
    whose = f" Each a rank's, the mean of {p['ranks']} ranks; shares of the slowest rank's step." if p else ""
    played = " The representative rank at the mean speed (--trace draws each rank)." if p else ""
    sections = [
        f"<h2>Summary</h2><pre>{escape(summary(d))}</pre>",
        *_fabric(d["hardware"]),
        "<h2>Memory over the step</h2><p>Stacked by category (hover for the values at a time); the dark line "
        "is reserved memory; shading: forward, backward, optimizer.</p>" + svg.timeline(result, mem),
        "<h2>Streams</h2><p>Each op a bar by phase (hover for its name and times)." + played + "</p>" + svg.gantt(result),
        "<h2>Breakdown at the peak</h2>" + _table(["category", "bytes", "share"], cats)
        + _table(["beside allocated", "bytes"], over) + "<h3>Largest live buffers</h3>"
        + _table(["buffer", "category", "bytes"], live),
        "<h2>Where the time goes</h2><p>The compute stream's kernels alone on the GPU by class, what running "
        "beside NCCL added, the time it waited for the CPU, and communication compute did not hide." + whose + "</p>"
        + _table(["", "time", "of the step"], times),
    ]
    return _page(f"fsdp-sim: {d['scenario']}", sections)


def _fabric(hw: dict) -> list[str]:
    """The collectives' pricing and what `variation:` names, in the summary's words; nothing for a plain scenario
    (results/report.variation_lines says when)."""
    var = hw.get("variation", {})
    if not var and "collective_pricing" not in hw:
        return []
    rows = [["pricing", pricing_words(hw)], *(["named in variation", w] for w in fault_words(var))]
    if "weakest_nic_node" in var:
        weakest = var["weakest_nic_node"]
        rows.append(["weakest node for rings", f"node {weakest['node']}, its NICs at "
                                               f"{100 * weakest['nic_sum_fraction']:.1f} % of their sum"])
    if "paced_by" in hw:
        rows.append(["compute paced by", hw["paced_by"]])
    return ["<h2>Fabric and variation</h2>" + _table(["", ""], rows)]


def sweep_report(title: str, keys: list[str], rows: list[dict], color_by: list[str], *, text: str = "",
                 best: dict | None = None) -> str:
    """The report of a sweep or recommendation: `text` (the recommendation) above the Pareto front and the
    sortable table of every row, the recommended one highlighted."""
    head = [*keys, "tokens/s per GPU", "step time", "MFU", "peak allocated", "required", "headroom", "fits",
            "exposed comm", "error"]
    table, classes = [], []
    for row in rows:
        swept = [("-" if row.get(k) is None else str(row.get(k)), None) for k in keys]
        if row.get("error"):
            table.append(swept + [""] * 8 + [row["error"]])
            classes.append("nofit")
            continue
        table.append(swept + [
            (f"{row['tokens_per_s_per_gpu']:.0f}", row["tokens_per_s_per_gpu"]),
            (fmt_time(row["step_time_s"]), row["step_time_s"]), (f"{100 * row['mfu']:.1f} %", row["mfu"]),
            (fmt_bytes(row["peak_allocated_bytes"]), row["peak_allocated_bytes"]),
            (fmt_bytes(row["required_bytes"]), row["required_bytes"]),
            (fmt_bytes(row["headroom_bytes"]), row["headroom_bytes"]), fit_word(row),
            (fmt_time(row["communication_exposed_s"]), row["communication_exposed_s"]), ""])
        classes.append("best" if row is best else ("" if row["fits"] else "nofit"))
    sections = [f"<p>{escape(tally(rows))}.</p>"]
    if text:
        sections.append(f"<h2>Recommendation</h2><pre>{escape(text)}</pre>")
    sections += ["<h2>Pareto front</h2><p>Tokens/s per GPU against required memory; hover a point for its "
                 "settings" + (", the star is the recommendation" if best is not None else "") + ".</p>"
                 + svg.pareto(rows, color_by, best),
                 "<h2>Every configuration</h2><p>Click a header to sort.</p>"
                 + _table(head, table, classes, sortable=True),
                 f'<script type="application/json" id="rows">{escape(json.dumps(rows))}</script>']
    return _page(title, sections)
