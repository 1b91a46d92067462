"""``clef-gguf pick``: this machine's profile and the recommended quant, in words or as JSON."""

from __future__ import annotations

import argparse
import json

from clef_gguf.core.argtypes import positive_int, seconds
from clef_gguf.core.cpus import available_cpus
from clef_gguf.core.errors import InvalidValue
from clef_gguf.core.limits import GB, GiB
from clef_gguf.pick import quality, speed
from clef_gguf.models.machine import DeviceProfile, probe
from clef_gguf.models.placement import (DEFAULT_CONTEXT, Candidate, Recommendation, fp4_note, gib, gpu_layers,
                                        recommend)


def _quant_list(text: str) -> list[str]:
    return [q.strip().upper() for q in text.split(",") if q.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", default="clef-flash", help="model family (default: clef-flash)")
    parser.add_argument("--ctx", type=positive_int, default=DEFAULT_CONTEXT,
                        help=f"the context the model will run with (its --max-length): the KV cache and a "
                             f"decision's activations are budgeted for this many tokens (default: {DEFAULT_CONTEXT})")
    parser.add_argument("--json", action="store_true", help="print the probe and recommendation as JSON")
    parser.add_argument("--eval", metavar="DIR",
                        help="the --output of a `clef-gguf eval` that compared quants side by side: "
                             "recommend the smallest quant that fits and keeps the reference's answers on "
                             "those records (top-1 agreement >= --min-agreement; without it, an accuracy "
                             "delta whose 95%% bootstrap interval reaches 0, else agreement >= "
                             f"{quality.DEFAULT_AGREEMENT:g})")
    parser.add_argument("--min-agreement", type=quality.agreement, metavar="X",
                        help="with --eval: the top-1 agreement with the eval's reference a quant must keep")
    speed_flags = parser.add_argument_group(
        "speed on this machine",
        "Before recommending, pick measures how long one decision takes here with each quant that fits: "
        "one interval of the family's decoder layers (3 linear-attention + 1 full-attention, at the real "
        "shapes, in each quant's tensor types) is prefilled through this llama.cpp build with the "
        "runtime's threads (16- and 64-token prefills: a part per call and a part per token), scaled to "
        "the whole tower, plus the joint head (and the vision tower, with --picture). ~66 s for all of "
        "Clef-Flash's quants on 2 cores; kept per "
        "machine, llama.cpp build, threads, --tokens and --picture, so the next pick is instant.")
    speed_flags.add_argument("--tokens", type=positive_int, default=speed.DEFAULT_TOKENS, metavar="N",
                             help=f"prompt tokens of the decision to time (default {speed.DEFAULT_TOKENS}, "
                                  "a typical request)")
    speed_flags.add_argument("--picture", type=positive_int, metavar="SIZE",
                             help="each decision also carries one SIZE x SIZE picture (448: 198 more prompt "
                                  "tokens on Clef-Flash): its tokens are added to --tokens and the vision "
                                  "tower's time on it (the default exact engine, random weights at "
                                  "Clef-Flash's vision shape) to every quant's seconds, and the vision "
                                  "tower's memory to every quant's need (with --no-probe: the memory only)")
    speed_flags.add_argument("--threads", type=positive_int, metavar="N",
                             help="CPU threads, as you will run the model (default: all available, as the runtime)")
    speed_flags.add_argument("--max-seconds", type=seconds, metavar="S",
                             help="recommend the most accurate quant that fits and is predicted to answer "
                                  "within S seconds (with --eval: the smallest that also keeps your answers)")
    speed_flags.add_argument("--prefer", choices=speed.PREFERENCES, default="quality",
                             help="quality (default): the most accurate quant that fits (and meets "
                                  "--max-seconds); speed: the fastest one that fits (and keeps your "
                                  "answers, with --eval)")
    speed_flags.add_argument("--quants", metavar="Q[,Q...]", type=_quant_list,
                             help="probe only these quants (default: every quant that fits); NVFP4A16-GGUF "
                                  "and NVFP4-GGUF (the NVFP4 checkpoints re-encoded for llama.cpp, pulled "
                                  "by name) are timed only when named here")
    speed_flags.add_argument("--no-probe", action="store_true",
                             help="skip the speed probe: memory (and --eval) only")
    speed_flags.add_argument("--reprobe", action="store_true",
                             help="measure again even if this machine's results are kept")
    parser.epilog = ("The recommendation is a GGUF quant. pick also lists the family's NVFP4 checkpoints "
                     "(clef-flash:nvfp4a16, clef-flash:nvfp4, clef:nvfp4; the nvfp4 backend, PyTorch on "
                     "CUDA) with their GPU memory need, and says whether this GPU runs FP4 natively "
                     "(Blackwell, compute capability 10.x/11.x/12.x: W4A4 on FP4 tensor cores) or through "
                     "the dequantizing fallback (other GPUs, and W4A16 everywhere), and beside each its NVFP4 "
                     "GGUF (clef-flash:nvfp4a16-gguf, clef-flash:nvfp4-gguf: the same codes through llama.cpp on "
                     "any device; --quants NVFP4A16-GGUF times it). They are never chosen automatically: pull "
                     "one by name.")


def measure_speed(args: argparse.Namespace, profile: DeviceProfile, rec: Recommendation) -> speed.SpeedTable | None:
    """The speed table for ``rec``'s candidates that fit (or ``--quants``), None with ``--no-probe``."""
    if args.no_probe:
        return None
    candidates = {c.quant.upper(): c for c in rec.candidates}
    known = candidates | {c.gguf.quant.upper(): c.gguf for c in rec.nvfp4 if c.gguf is not None}  # when named
    if args.quants:
        unknown = [q for q in args.quants if q not in known]
        if unknown:
            raise InvalidValue(f"--quants: {', '.join(unknown)} not published for {rec.family} "
                               f"(choose from {', '.join(known)})", field="quants")
        wanted = list(args.quants)
    else:
        wanted = [q for q, c in candidates.items() if c.fits]  # the NVFP4 GGUFs only by name
    if not wanted:
        return None
    placed = {q: gpu_layers(profile, known[q].size_bytes, rec.family, context_tokens=args.ctx) for q in wanted}
    return speed.measure(rec.family, wanted, tokens=args.tokens, threads=args.threads or available_cpus(),
                         gpu_layers=placed, reprobe=args.reprobe, picture=args.picture)


def run(args: argparse.Namespace) -> int:
    """``clef-gguf pick``: print this machine's profile and the recommended quant; 1 if nothing fits."""
    choosing = args.max_seconds is not None or args.prefer == "speed"  # by the probe's seconds
    if args.no_probe and args.reprobe:
        raise InvalidValue("--no-probe and --reprobe contradict each other: give one", field="reprobe")
    if args.no_probe and choosing:
        raise InvalidValue("--max-seconds and --prefer speed need the speed probe: drop --no-probe",
                           field="no_probe")
    if args.min_agreement is not None and not args.eval:
        raise InvalidValue("--min-agreement needs --eval DIR (a clef-gguf eval of the quants)",
                           field="min_agreement")
    profile = probe()
    rec = recommend(profile, args.family, context_tokens=args.ctx, pictures=args.picture is not None)
    summary = quality.load(args.eval) if args.eval else None
    if summary is not None:
        rec = quality.apply(rec, summary, args.min_agreement)
    table = measure_speed(args, profile, rec)
    if table is not None and choosing:
        keeps = None
        if summary is not None:
            keeps = {q for q, v in quality.verdicts(summary, args.min_agreement).items() if v.keeps}
        rec = speed.apply(rec, speed.choose(rec, table, max_seconds=args.max_seconds, prefer=args.prefer,
                                            keeps=keeps))
    elif table is None and choosing:  # --no-probe with choosing was refused above
        raise InvalidValue(f"no speed probe for {rec.family}: its tower shapes are not confirmed, so "
                           "--max-seconds and --prefer speed cannot choose", field="family")
    agreements = quality.agreements(summary) if summary is not None else {}
    if args.json:
        print(json.dumps({"device": profile.to_dict(), "recommendation": rec.to_dict(),
                          "speed": table.to_dict() if table is not None else None,
                          "table": rows(rec, table, agreements)}, indent=2))
        return 0 if rec.ok else 1
    feats = [n for n, on in (("AVX2", profile.avx2), ("AVX-512", profile.avx512), ("NEON", profile.neon)) if on]
    print(f"RAM:  {gib(profile.total_ram)} total, {gib(profile.available_ram)} available")
    print(f"CPU:  {profile.arch}, {profile.cpu_count} threads, features: {', '.join(feats) or 'none detected'}")
    if profile.gpus:
        for g in profile.gpus:
            free = f", {gib(g.vram_free)} free" if g.vram_free is not None else ""
            fp4 = "" if profile.unified_memory else f"; NVFP4: {fp4_note(g)}"
            print(f"GPU:  {g.index}: {g.name}, {gib(g.vram_total)} VRAM{free}{fp4}")
        offload = {True: "yes", False: "no (CPU-only build)", None: "unknown"}[profile.gpu_offload]
        print(f"      llama.cpp GPU offload: {offload}")
    else:
        print("GPU:  none")
    print(f"llama.cpp backends: {', '.join(('CPU',) + profile.backends)}"
          + ("" if profile.backends else " (a CPU-only build; see README for CUDA/Metal/Vulkan)"))
    print()
    print_table(rec, table, agreements, args)
    if rec.ok and rec.placement:
        print(f"Recommended: {rec.name} (on {rec.placement.upper()})")
    else:
        print("Recommended: nothing fits")
    print(rec.reason)
    if rec.nvfp4:
        print()
        print("NVFP4 checkpoints (nvfp4 backend; pulled by name, never chosen automatically):")
        for c in rec.nvfp4:
            mark = "+" if c.suitable else "-"
            print(f"  {mark} {c.reason}")
            if c.gguf is not None:
                print(f"      {gguf_line(rec.family, c.gguf, table)}")
    return 0 if rec.ok else 1


def gguf_line(family: str, c: Candidate, table: speed.SpeedTable | None) -> str:
    """One NVFP4 GGUF in words: its name, size, memory and fit, and its predicted seconds when timed."""
    where = "on the GPU" if c.fits_gpu else "on the CPU" if c.fits_cpu else "nowhere here"
    line = (f"as an NVFP4 GGUF, {family}:{c.quant.lower()} (llama.cpp, re-encoded on first use): "
            f"~{c.size_bytes / GB:.2f} GB, {c.need_bytes / GiB:.1f} GiB of memory, fits {where}")
    s = table.get(c.quant) if table is not None else None
    if table is not None and s is not None and s.seconds is not None:
        return line + f"; predicted {s.seconds:.1f} s for {table.decision()}"
    if s is not None and s.error:
        return line + f"; probe failed: {s.error}"
    return line + f" (pick --quants {c.quant} times it)"


def rows(rec: Recommendation, table: speed.SpeedTable | None, agreements: dict[str, float]) -> list[dict]:
    """One row per published quant: size, memory at --ctx, fits, predicted seconds, tokens/s, agreement;
    then the NVFP4 GGUFs (``by_name``: never chosen automatically)."""
    out = []
    for c in [*rec.candidates, *(n.gguf for n in rec.nvfp4 if n.gguf is not None)]:
        s = table.get(c.quant) if table is not None else None
        out.append({"quant": c.quant, "size_bytes": c.size_bytes, "size_basis": c.size_basis,
                    "memory_bytes": c.need_bytes, "fits": c.fits,
                    "seconds": s.seconds if s else None, "tokens_per_second": s.tokens_per_second if s else None,
                    "probe_error": s.error if s else None, "under_load": bool(s and s.loaded),
                    "agreement": agreements.get(c.quant.upper()), "by_name": c not in rec.candidates})
    return out


def print_table(rec: Recommendation, table: speed.SpeedTable | None, agreements: dict[str, float],
                args: argparse.Namespace) -> None:
    if table is not None:
        when = (f"kept from {table.measured_at} (--reprobe measures again)" if table.cached
                else f"measured now in {table.took_seconds:.0f} s")
        print(f"Speed here: {table.decision()} with {table.threads} threads, {when}.")
        print(f"  (predicted from {table.probe_layers} of {table.layers} layers at the real shapes; "
              f"head {table.head_seconds * 1e3:.0f} ms included)")
        if table.loaded_quants:
            busiest = max((s.load or {}).get("contended_cores", 0.0) for s in table.quants.values())
            print(f"  Under load: other processes kept up to {busiest:.1f} of the probe's {table.threads} "
                  f"cores busy while {', '.join(table.loaded_quants)} were timed (twice each): their seconds "
                  "may read high. The next pick measures them again once the machine is quiet "
                  "(or: pick --reprobe).")
    elif not args.no_probe:
        print(f"Speed: no probe for {rec.family} (its tower shapes are not confirmed); memory only.")
    head = f"  {'quant':<8} {'file GB':>8} {'memory GiB':>10} {'fits':>4}"
    if table is not None:
        head += f" {'seconds':>8} {'tok/s':>6}"
    if agreements:
        head += f" {'top-1 agreement':>15}"
    print(head)
    for r in rows(rec, table, agreements):
        if r["by_name"]:  # the NVFP4 GGUFs: under the NVFP4 checkpoints below
            continue
        line = (f"  {r['quant']:<8} {r['size_bytes'] / 1e9:>8.2f} {r['memory_bytes'] / GiB:>10.1f} "
                f"{'yes' if r['fits'] else 'no':>4}")
        if table is not None:
            ok = r["seconds"] is not None
            line += f" {r['seconds']:>8.1f} {r['tokens_per_second']:>6.0f}" if ok else f" {'-':>8} {'-':>6}"
        if agreements:
            a = r["agreement"]
            line += f" {a:>15.4f}" if a is not None else f" {'-':>15}"
        if r["probe_error"]:
            line += f"  (probe failed: {r['probe_error']})"
        elif r["under_load"]:
            line += "  (timed under load)"
        print(line)
    print()
