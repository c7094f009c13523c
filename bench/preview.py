"""Cost of Clover's preview (denoising) pass against a plain causal pass over the same block, side by side.

    python bench/preview.py                          # bench-clover preset, 1/8/32 rows, fp32, 2 threads
    python bench/preview.py --rows 1 16 --reps 20 --prefix 1024 --threads 2

One run, the engine's own forward (`forward_slots` over preallocated slots): every row holds a committed prefix of
--prefix tokens, and one block of block_size tokens is forwarded per row, either as a preview (Clover's operator:
right conv taps, history-slot softmax mixer, bidirectional attention; nothing written) or as a causal commit (the
trunk: causal conv and gated delta rule, causal attention, the state written). Also timed: the GDN mixer alone
(preview conv + history mixer vs causal conv + chunked delta rule) on one layer's inputs. Reported: median ms per
forward, and the preview / causal ratio. The state a commit writes is restored, untimed, before each rep.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from clover_batch.model import load_model
from clover_batch.model.slots import SlotState


def median_ms(fn, reps: int, setup=None) -> float:
    """Median milliseconds of `fn` after one warm-up call; `setup` runs before each call, untimed."""
    times = []
    for _ in range(reps + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


def measure(model, rows: int, prefix: int, reps: int, gen: torch.Generator) -> tuple[float, float, float, float]:
    """(preview ms, causal ms) of a whole forward over one block per row, and of one GDN layer's mixer alone."""
    cfg = model.config
    bs = cfg.diffusion.block_size
    page = 256
    per_row = -(-(prefix + bs) // page)
    slots = SlotState(cfg, rows, window=cfg.window_tokens, max_forward_tokens=max(prefix, bs),
                      num_pages=rows * per_row, page_size=page, device=model.device, dtype=model.dtype)
    for slot in range(rows):  # pages for the prefix and the block
        slots.grow(slot, prefix + bs)
    ids = torch.randint(0, cfg.vocab_size, (rows, prefix), generator=gen)
    model.forward_slots(ids, slots.rows(0, [0] * rows, prefix, None), attention="causal", keep_logits=0)
    # what a commit changes and a later one reads: GDN states, positions (its keys land on the same entries)
    state = [t for t in (*slots.recurrent, *slots.conv) if t is not None] + [slots.positions, slots.pool_pos]
    saved = [t.clone() for t in state]

    def restore() -> None:
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)

    block = torch.randint(0, cfg.vocab_size, (rows, bs), generator=gen)
    lengths = [prefix] * rows

    def preview() -> None:
        model.forward_slots(block, slots.rows(0, lengths, bs, []), attention="block_causal", keep_logits=None,
                            preview=True)

    def causal() -> None:
        model.forward_slots(block, slots.rows(0, lengths, bs, None), attention="causal", keep_logits=None)

    t_preview, t_causal = median_ms(preview, reps, restore), median_ms(causal, reps, restore)
    # the GDN mixer alone, on one layer's projections of the block
    gdn = next(layer.linear_attn for layer in model.layers if layer.kind == "linear_attention")
    x = torch.randn(rows, bs, cfg.hidden_size, generator=gen)
    with torch.inference_mode():
        p = gdn._project(x)
        rec, conv = slots.recurrent[0], slots.conv[0]
        m_preview = median_ms(lambda: gdn._preview(p, rec, conv), reps)
        m_causal = median_ms(lambda: gdn._causal(p, rec, conv), reps)
    return t_preview, t_causal, m_preview, m_causal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="bench-clover")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prefix", type=int, default=512, help="committed tokens per row before the block")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.preset, seed=0)
    cfg = model.config
    assert cfg.diffusion is not None and cfg.diffusion.clover, "a preset in Clover's layout (bench-clover)"
    bs = cfg.diffusion.block_size
    prefix = args.prefix // bs * bs
    print(f"preview vs causal pass, {args.preset}: block {bs}, prefix {prefix} tokens, fp32, {args.threads} threads")
    print(f"{'rows':>5} {'preview ms':>11} {'causal ms':>10} {'ratio':>6}   {'GDN mix: preview ms':>20} "
          f"{'causal ms':>10} {'ratio':>6}")
    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        t_preview, t_causal, m_preview, m_causal = measure(model, rows, prefix, args.reps, gen)
        print(f"{rows:>5} {t_preview:>11.2f} {t_causal:>10.2f} {t_preview / t_causal:>6.2f}   {m_preview:>20.3f} "
              f"{m_causal:>10.3f} {m_preview / m_causal:>6.2f}")
    print("preview: Clover's denoising pass (nothing written); causal: the commit pass of the same block (the "
          "trunk); GDN mix: one layer's conv + mixer only")


if __name__ == "__main__":
    main()
