"""Predicted (two cost curves: measured before and after the sweep) beside measured, per cell, as markdown."""
import json, statistics, sys
from ddtree.lab.report import load_run
run, before, after = sys.argv[1:4]
res = load_run(run)
def idx(path): return {(c["config"], c["context"], c["concurrency"]): c for c in json.load(open(path))["cells"]}
b, a = idx(before), idx(after)
name = {"ar": "ar", "dflash-bstrained-wnone": "dflash"}
rows, eb, ea = [], [], []
for cfg in res.configs:
    key = name.get(cfg.config_id) or f"ddtree-b{cfg.settings['budget']}-knone"
    for ctx in res.contexts:
        for conc in res.concurrency:
            cell, k = cfg.cell(ctx, conc), (key, ctx, conc)
            m, x, y = cell.tok_s, b[k]["tok_s"], a[k]["tok_s"]
            e1, e2 = (x - m) / m * 100, (y - m) / m * 100
            eb.append((cfg.method, abs(e1))); ea.append((cfg.method, abs(e2)))
            rows.append(f"| {res.label(cfg.config_id)} | {ctx} | {conc} | {m:.1f} [{cell.tok_s_min:.1f}..{cell.tok_s_max:.1f}] "
                        f"| {cell.accept_length:.2f} / {a[k]['accept_length']:.2f} | {x:.1f} | {e1:+.0f}% | {y:.1f} | {e2:+.0f}% |")
print("| config | ctx | C | measured tok/s [min..max of 2] | accept measured / replayed | predicted, curve before | error | predicted, curve after | error |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
print("\n".join(rows))
for lab, e in (("before", eb), ("after", ea)):
    v = [x for _, x in e]; dd = [x for m, x in e if m == "ddtree"]
    print(f"\n{lab}: mean |error| {statistics.fmean(v):.1f}% (median {statistics.median(v):.1f}%), within 10%: {sum(x <= 10 for x in v)}/{len(v)}; "
          f"DDTree cells: mean {statistics.fmean(dd):.1f}%, within 10%: {sum(x <= 10 for x in dd)}/{len(dd)}")
