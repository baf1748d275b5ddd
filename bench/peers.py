"""mha (fp32, bf16, fp16) against the CPU peers, side by side in one process: PyTorch 2.x SDPA (fp32, bf16, fp16),
OpenVINO's opset13 scaled_dot_product_attention (INFERENCE_PRECISION_HINT f32 and bf16: without
the hint it may silently run bf16), ONNX Runtime's com.microsoft.MultiHeadAttention (fp32; inputs
(B, T, H·D); its flash path has no causal mask, so causal rows show "—").

Each cell: GFLOP/s (4·B·H·Tq·Tk·D, causal counting only the visible part), the relative error
against torch float64 on the float32 inputs (so 16-bit columns include the rounding of their
inputs), and the speed of mha in the same precision (fp32, bf16 or fp16) over the cell's.
Timing: the median of repeated calls over at least --seconds, after a warm-up; 2 threads for
every library. Run through bench/peers.sh, which installs the peers; the fp32 FMA peak comes from
`mha bench --peak` (--peak here).

  python bench/peers.py --peak 542 [--seconds 1] [--markdown docs/bench/peers.md] [--json peers.json]
  python bench/plot_peers.py peers.json docs/bench/peers.png
"""
import argparse
import json
import statistics
import time

import numpy as np
import torch

import mha

SHAPES = [  # (B, H, T, D, causal): the table of issue 12
    (4, 12, 512, 64, False),
    (1, 8, 4096, 64, False),
    (1, 16, 2048, 128, True),
    (8, 12, 128, 64, False),
]
THREADS = 2


def flops(B, H, T, D, causal):
    pairs = T * (T + 1) / 2 if causal else T * T
    return 4.0 * B * H * pairs * D


def median_seconds(fn, seconds):
    fn()  # warm-up: compilation, first-touch pages, thread pools
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    time.sleep(0.05)  # let spinning pool threads go idle before the next library runs
    return statistics.median(times)


def rel_error(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def torch_case(q, k, v, causal, dtype):
    a, b, c = (x.to(dtype) for x in (q, k, v))
    run = lambda: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
    return run, lambda: run().float().numpy()


def mha_case(q, k, v, causal, dtype=torch.float32):
    """mha on torch tensors of dtype (through DLPack, no copies; float32 also as numpy)."""
    if dtype == torch.float32:
        a, b, c = (x.numpy() for x in (q, k, v))
        run = lambda: mha.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
        return run, run
    a, b, c = (x.to(dtype) for x in (q, k, v))
    run = lambda: mha.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
    return run, lambda: run().float().numpy()


def openvino_case(q, k, v, causal, precision):
    import openvino as ov
    import openvino.opset13 as ops

    params = [ops.parameter(list(x.shape), ov.Type.f32) for x in (q, k, v)]
    out = ops.scaled_dot_product_attention(*params, causal=causal)
    model = ov.Model([out], params)
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": precision,
                                                      "INFERENCE_NUM_THREADS": THREADS})
    request = compiled.create_infer_request()
    inputs = [x.numpy() for x in (q, k, v)]
    run = lambda: request.infer(inputs)  # noqa: E731
    return run, lambda: np.array(run()[0])


def onnxruntime_case(q, k, v, causal):
    if causal:
        return None
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    B, H, T, D = q.shape
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, T, H * D]) for n in ("q", "k", "v", "o")]
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=H)
    graph = helper.make_graph([node], "mha", io[:3], io[3:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {n: np.ascontiguousarray(x.permute(0, 2, 1, 3).reshape(B, T, H * D).numpy())
             for n, x in zip(("q", "k", "v"), (q, k, v))}
    run = lambda: session.run(None, feeds)  # noqa: E731
    return run, lambda: run()[0].reshape(B, T, H, D).transpose(0, 2, 1, 3)


BACKWARD_SHAPES = [(1, 8, 2048, 64, True), (4, 12, 512, 64, False), (1, 16, 2048, 128, True)]


def backward_flops(B, H, T, D, causal):
    """dQ, dK, dV: five T×T×D products (S and dP recomputed or read, dV, dQ, dK): 2.5× the forward."""
    return 2.5 * flops(B, H, T, D, causal)


def backward_table(args):
    """Forward + backward through autograd, mha against torch, fp32 and bf16 (fp16 too)."""
    header = ["shape (B, H, T, D)"] + [f"{lib} {n}" for n in ("fp32", "bf16", "fp16") for lib in ("mha", "torch")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for B, H, T, D, causal in BACKWARD_SHAPES:
        gen = torch.Generator().manual_seed(0)
        base = [torch.randn(B, H, T, D, generator=gen) for _ in range(3)]
        dout = torch.randn(B, H, T, D, generator=gen)
        work = flops(B, H, T, D, causal) + backward_flops(B, H, T, D, causal)
        cells = []
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            xs = [b.to(dtype).requires_grad_() for b in base]
            g = dout.to(dtype)
            seconds = {}
            for lib, fn in (("mha", mha.scaled_dot_product_attention),
                            ("torch", torch.nn.functional.scaled_dot_product_attention)):
                def step():
                    for x in xs:
                        x.grad = None
                    fn(*xs, is_causal=causal).backward(g)
                seconds[lib] = median_seconds(step, args.seconds)
            cells.append(f"{work / seconds['mha'] / 1e9:.0f} ({seconds['torch'] / seconds['mha']:.2f}×)")
            cells.append(f"{work / seconds['torch'] / 1e9:.0f}")
        shape = f"({B}, {H}, {T}, {D}){' causal' if causal else ''}"
        lines.append("| " + " | ".join([shape] + cells) + " |")
        print(lines[-1], flush=True)
    note = ("\nForward + backward through autograd (loss·dout), GFLOP/s counting the forward (4·T²·D per head) "
            "and the backward (2.5× the forward), causal on the visible half; mha's cells give its speed over "
            f"torch's in the same dtype. {THREADS} threads; torch {torch.__version__}.\n")
    return "\n".join(lines) + "\n" + note


def onnxruntime_gqa_decode(q, k, v, quant):
    """ONNX Runtime's com.microsoft.GroupQueryAttention decoding one token after the cache k, v
    (Hkv, L, D): float32, or int8 with a per-tensor scale (its kv_cache_bit_width=8 cache). Each
    call also writes present_key/value (past plus the new token): without IO binding's shared
    buffers that is a copy of the cache, which a serving loop would avoid."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    Hq, D = q.shape[1], q.shape[3]
    Hkv, L = k.shape[0], k.shape[1]
    cache_t = TensorProto.INT8 if quant else TensorProto.FLOAT
    info = helper.make_tensor_value_info
    inputs = [info("query", TensorProto.FLOAT, [1, 1, Hq * D]), info("key", TensorProto.FLOAT, [1, 1, Hkv * D]),
              info("value", TensorProto.FLOAT, [1, 1, Hkv * D]), info("past_key", cache_t, [1, Hkv, L - 1, D]),
              info("past_value", cache_t, [1, Hkv, L - 1, D]), info("seqlens_k", TensorProto.INT32, [1]),
              info("total_sequence_length", TensorProto.INT32, [])]
    names = [i.name for i in inputs]
    attrs = dict(num_heads=Hq, kv_num_heads=Hkv)
    feeds = {"query": q.reshape(1, 1, Hq * D).numpy(), "key": k[:, -1:].reshape(1, 1, Hkv * D).numpy(),
             "value": v[:, -1:].reshape(1, 1, Hkv * D).numpy(), "seqlens_k": np.array([L - 1], np.int32),
             "total_sequence_length": np.array(L, np.int32)}
    past_k, past_v = k[None, :, :-1], v[None, :, :-1]
    if quant:
        ks, vs = float(past_k.abs().max()) / 127, float(past_v.abs().max()) / 127
        feeds["past_key"] = torch.round(past_k / ks).to(torch.int8).numpy()
        feeds["past_value"] = torch.round(past_v / vs).to(torch.int8).numpy()
        inputs += [info("k_scale", TensorProto.FLOAT, [1]), info("v_scale", TensorProto.FLOAT, [1])]
        names += ["", "", "", "", "", "k_scale", "v_scale"]
        feeds["k_scale"], feeds["v_scale"] = np.array([ks], np.float32), np.array([vs], np.float32)
        attrs.update(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8)
    else:
        feeds["past_key"], feeds["past_value"] = past_k.contiguous().numpy(), past_v.contiguous().numpy()
    outs = [info(n, TensorProto.FLOAT if n == "output" else cache_t, None) for n in ("output", "present_key",
                                                                                     "present_value")]
    node = helper.make_node("GroupQueryAttention", names, ["output", "present_key", "present_value"],
                            domain="com.microsoft", **attrs)
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    run = lambda: session.run(["output"], feeds)  # noqa: E731
    return run, lambda: run()[0].reshape(1, 1, Hq, D).transpose(0, 2, 1, 3)


def openvino_decode(q, k, v, precision):
    """OpenVINO's ScaledDotProductAttention op decoding one token over the cache k, v (Hkv, L, D)
    as float32 tensors: the G = Hq / Hkv query heads of a kv head as G query rows of one head
    (no mask: the same attention, without repeating K and V per query head). The op's own GQA
    form, K and V broadcast over a query-head axis, ran 85 ms where this runs 70 (f32, 2
    threads). precision: the plugin's inference precision ("f32", or "bf16": K and V converted
    inside each call). Inputs are shared, not copied."""
    import openvino as ov
    import openvino.opset13 as ops

    Hq, D = q.shape[1], q.shape[3]
    Hkv, L = k.shape[0], k.shape[1]
    shapes = ([1, Hkv, Hq // Hkv, D], [1, Hkv, L, D], [1, Hkv, L, D])
    params = [ops.parameter(shape, ov.Type.f32) for shape in shapes]
    model = ov.Model([ops.scaled_dot_product_attention(*params, causal=False)], params)
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": precision,
                                                      "INFERENCE_NUM_THREADS": THREADS})
    request = compiled.create_infer_request()
    inputs = [np.ascontiguousarray(x.reshape(s).numpy()) for x, s in zip((q, k, v), shapes)]
    run = lambda: request.infer(inputs, share_inputs=True)  # noqa: E731
    return run, lambda: np.array(run()[0]).reshape(1, Hq, 1, D)


def decode_table(args):
    """One decoding step (GQA 32/8, D = 128, 32768 positions: a 256 MiB float32 cache) from mha's
    caches of every storage type against torch SDPA over the cache as float32 (a torch user's
    quantized cache, dequantized to float32 first; the dequantization is not timed) and over
    bfloat16 K/V. Also the output error against torch float64 on the float32 values."""
    Hq, Hkv, D, L = 32, 8, 128, 32768
    gen = torch.Generator().manual_seed(0)
    k = torch.rand(Hkv, L, D, generator=gen) * 2 - 1
    v = torch.rand(Hkv, L, D, generator=gen) * 2 - 1
    q = torch.randn(1, Hq, 1, D, generator=gen)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k[None].double(), v[None].double(),
                                                            enable_gqa=True).numpy()
    flops = 4 * Hq * L * D  # q·k and p·v: 2 flops per multiply-add
    lines = ["| cache | MiB | ms | GB/s | GFLOP/s (% fp32 peak) | × mha float32 | error vs float64 |",
             "|---|---|---|---|---|---|---|"]
    base = None

    def row(name, nbytes, seconds, error):
        gflops = flops / seconds / 1e9
        lines.append(f"| {name} | {nbytes / 2**20:.0f} | {seconds * 1e3:.2f} | {nbytes / seconds / 1e9:.1f} | "
                     f"{gflops:.1f} ({100 * gflops / args.peak:.0f}%) | {seconds / base:.2f} | {error:.1e} |")
        print(lines[-1], flush=True)

    for dtype in ("float32", "bfloat16", "float16", "int8", "int4"):
        cache = mha.PagedKvCache(Hkv, D, page_size=256, pages=L // 256, dtype=dtype)
        s = cache.add_sequence()
        cache.append(s, k, v)
        run = lambda: cache.attend(q, [s], num_threads=THREADS)  # noqa: E731
        seconds = median_seconds(run, args.seconds)
        base = base or seconds
        row(f"mha {dtype}", cache.nbytes, seconds, rel_error(run().numpy(), want))
    for name, dt in (("torch SDPA float32", torch.float32), ("torch SDPA bfloat16", torch.bfloat16)):
        kk, vv, qq = k[None].to(dt), v[None].to(dt), q.to(dt)
        run = lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)  # noqa: E731
        seconds = median_seconds(run, args.seconds)
        row(name, 2 * kk.numel() * kk.element_size(), seconds, rel_error(run().float().numpy(), want))
    peers = [("OpenVINO SDPA float32", lambda: openvino_decode(q, k, v, "f32"), 4),
             ("OpenVINO SDPA, bf16 inference", lambda: openvino_decode(q, k, v, "bf16"), 4),
             ("ORT GroupQueryAttention float32", lambda: onnxruntime_gqa_decode(q, k, v, False), 4),
             ("ORT GroupQueryAttention int8", lambda: onnxruntime_gqa_decode(q, k, v, True), 1)]
    for name, make, element_bytes in peers:
        try:
            run, result = make()
        except Exception as e:  # noqa: BLE001 — a peer without the feature is a row saying so
            lines.append(f"| {name} | — | not available: {str(e)[:80]} | | | | |")
            continue
        seconds = median_seconds(run, args.seconds)
        row(name, 2 * k.numel() * element_bytes, seconds, rel_error(result(), want))
    note = (f"\nOne decoding step, GQA {Hq}/{Hkv}, D = {D}, {L} positions; mha through PagedKvCache.attend (one "
            f"sequence, pages of 256); torch over the cache as float32/bfloat16 tensors (a dequantized cache); "
            f"OpenVINO's ScaledDotProductAttention op over the float32 cache (a kv head's query heads as its query "
            f"rows); ONNX Runtime's GroupQueryAttention also copies past to present on each call (no IO binding). "
            f"{THREADS} threads, fp32 FMA peak {args.peak:.0f} GFLOP/s (mha bench --peak); a step is {flops / 1e6:.0f} "
            f"MFLOP; torch {torch.__version__}.\n")
    return "\n".join(lines) + "\n" + note


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak", type=float, required=True, help="fp32 FMA peak in GFLOP/s (mha bench --peak)")
    parser.add_argument("--bf16-peak", type=float, default=None,
                        help="bf16 peak in GFLOP/s: AMX tile products where the CPU has them, else vdpbf16ps")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--markdown", default=None, help="also write the table here")
    parser.add_argument("--json", default=None, help="also write GFLOP/s per shape and column here (plot_peers.py)")
    parser.add_argument("--backward", action="store_true", help="only the forward+backward table (mha vs torch)")
    parser.add_argument("--decode", action="store_true",
                        help="only the decoding table (cache types vs torch, OpenVINO, ORT)")
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    if args.backward or args.decode:
        table = backward_table(args) if args.backward else decode_table(args)
        print("\n" + table)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(table)
        return
    # (name, the mha column it is compared with, case maker)
    peers = [("torch fp32", "fp32", lambda q, k, v, c: torch_case(q, k, v, c, torch.float32)),
             ("torch bf16", "bf16", lambda q, k, v, c: torch_case(q, k, v, c, torch.bfloat16)),
             ("torch fp16", "fp16", lambda q, k, v, c: torch_case(q, k, v, c, torch.float16)),
             ("OpenVINO f32", "fp32", lambda q, k, v, c: openvino_case(q, k, v, c, "f32")),
             ("OpenVINO bf16", "bf16", lambda q, k, v, c: openvino_case(q, k, v, c, "bf16")),
             ("ORT fp32 MHA", "fp32", onnxruntime_case)]
    mine = [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)]
    header = ["shape (B, H, T, D)"] + [f"mha {n}" for n, _ in mine] + [name for name, _, _ in peers]
    rows, results = [], []
    for B, H, T, D, causal in SHAPES:
        numbers = {}
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, generator=gen) for _ in range(3))
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                                is_causal=causal).numpy()
        work = flops(B, H, T, D, causal)
        mha_seconds, cells = {}, []
        for label, dtype in mine:
            run, result = mha_case(q, k, v, causal, dtype)
            mha_seconds[label] = median_seconds(run, args.seconds)
            gflops = work / mha_seconds[label] / 1e9
            numbers[f"mha {label}"] = gflops
            peak = f"{100 * gflops / args.peak:.0f}% fp32 peak"
            if label == "bf16" and args.bf16_peak:
                peak += f", {100 * gflops / args.bf16_peak:.0f}% bf16 peak"
            cells.append(f"{gflops:.0f} ({peak}, {rel_error(result(), want):.0e})")
        for name, versus, make in peers:
            case = make(q, k, v, causal)
            if case is None:
                cells.append("—")
                continue
            run, result = case
            seconds = median_seconds(run, args.seconds)
            numbers[name] = work / seconds / 1e9
            cells.append(f"{work / seconds / 1e9:.0f} ({rel_error(result(), want):.0e}; mha {versus} "
                         f"{seconds / mha_seconds[versus]:.2f}×)")
        shape = f"({B}, {H}, {T}, {D}){' causal' if causal else ''}"
        rows.append([shape] + cells)
        results.append({"shape": shape, "gflops": numbers})
        print(" | ".join([shape] + cells), flush=True)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    table = "\n".join(lines)
    note = (f"\nGFLOP/s (relative error vs torch float64 on the float32 inputs; the speed of the mha column of the "
            f"same precision over the cell's). fp32 FMA peak "
            f"{args.peak:.0f} GFLOP/s" + (f", bf16 peak {args.bf16_peak:.0f}" if args.bf16_peak else "") +
            f"; {THREADS} threads; torch {torch.__version__}.\n")
    print("\n" + table + note)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n" + note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak": args.peak, "bf16_peak": args.bf16_peak, "threads": THREADS, "torch": torch.__version__,
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
