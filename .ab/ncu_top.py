"""Rank SASS lines of ncu's source page CSV by warp stall samples; print top N with neighbours."""
import csv, sys
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
hdr_i = next(i for i, r in enumerate(rows) if any("Warp Stall Sampling" in c for c in r))
hdr = rows[hdr_i]
body = [r for r in rows[hdr_i + 1:] if len(r) == len(hdr)]
ci = next(i for i, c in enumerate(hdr) if "Warp Stall Sampling (All" in c)
src = next((i for i, c in enumerate(hdr) if c.strip() == "Source"), 1)
addr = next((i for i, c in enumerate(hdr) if "Address" in c), 0)
def val(r):
    try: return float(r[ci].replace(",", ""))
    except ValueError: return 0.0
tot = sum(val(r) for r in body) or 1
print("columns:", [c for c in hdr][:12], "total samples", tot, "lines", len(body))
for r in sorted(body, key=val, reverse=True)[:n]:
    print(f"{100*val(r)/tot:5.1f}% {r[addr]} {r[src][:110]}")
