"""Where a calibrated constant holds (docs/calibration.md, "Domain"): e4m3 quantized_matmul
(8x128x8), p = 0.02, confidence 0.9, 300 samples per distribution, fitted on normal data and
on normal + activation-like data; on N fresh instances of each distribution: the fraction
over kappa, the fraction the domain check warns on, and the fraction over kappa without a
warning. ``python bench/calibration_domain.py [N=1000]`` (~10 min on 2 loaded cores)."""
import sys, torch
from ttrace_num import calibrate as C, scaling
from ttrace_num.calibrate.distributions import DISTRIBUTIONS
from ttrace_num.calibrate.ops import Setup, op_shapes, SPECS
from ttrace_num.formats import get_format
torch.set_num_threads(1)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
op = "quantized_matmul"
s = Setup(get_format("e4m3"), get_format("fp32"), scaling.get_recipe("tensor"), get_format("fp32"))
shapes = op_shapes(op, s, None)
for dists in [tuple(sys.argv[2].split(","))] if len(sys.argv) > 2 else (("normal",), ("normal", "activations")):
    cal = C.calibrate("e4m3", [op], seed=0, distributions=dists)
    e = cal.ops[op]
    print(f"fit on {dists}: kappa={e.kappa:.4g} per-dist={ {k: round(v['kappa'], 4) for k, v in e.per_distribution.items()} }", flush=True)
    for d in (sys.argv[3].split(",") if len(sys.argv) > 3 else ("normal", "activations", "heavy", "lognormal")):
        g = torch.Generator().manual_seed(777)
        viol = warned = viol_silent = 0
        for j in range(N):
            xs = SPECS[op].prepare(C._draw(op, shapes, (d, DISTRIBUTIONS[d]), None, g), s)
            r = float(C._ratios(op, s, xs)[0])
            w = bool(C.domain_problems(op, e, xs))
            viol += r > e.kappa; warned += w; viol_silent += (r > e.kappa) and not w
        print(f"  {d:12s} violations {100*viol/N:.1f}%  warned {100*warned/N:.1f}%  "
              f"violations without a warning {100*viol_silent/N:.1f}% of instances", flush=True)
