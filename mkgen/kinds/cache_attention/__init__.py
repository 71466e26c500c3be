"""What GQA and MLA share: a KV cache written in aligned blocks and read in double-buffered
tiles under an online softmax (macros.py.j2 beside it)."""

from __future__ import annotations

from typing import Any


def buffers(
    out: Any, name: str, dims: Any, kvh: int, qr: int, widths: tuple[int, int, int],
    sinks: bool = False,
) -> None:  # fmt: skip
    """Exactly the template's scratch of a kind with a KV cache (same order, same shapes).

    widths: cache arrays (k and v: 2; the MLA latent row: 1), key width, value width."""
    b, r = dims.batch, dims.rows
    caches, d, dv = widths
    out.add(f"{name}_kv_new_vmem", "attention", (caches, b, kvh, r, d), "bf16",
            why="the step's new cache rows")  # fmt: skip
    out.add(f"{name}_q_vmem", "attention", (b, kvh, qr, d), "f32", why="q rows per kv head")
    out.add(f"{name}_o_vmem", "attention", (b, kvh, qr, dv), "f32", why="attention outputs")
    out.add(f"{name}_tiles_vmem", "attention", (caches, 2, dims.kv_tiles[name], d), "bf16",
            resource=f"{name}.tiles", slots=2, why="cache tiles, double buffered")  # fmt: skip
    out.sems(f"{name}_tile_sems", (caches, 2))
    out.sems(f"{name}_write_sems", (caches, b, kvh))
    out.add(f"{name}_block_vmem", "attention", (caches, b, kvh, dims.cache_block, d), "bf16",
            resource=f"{name}.block", why="cache rows rewritten around the new entries")  # fmt: skip
    if sinks:
        out.add(f"{name}_sinks_vmem", "attention", (kvh, qr, 128), "f32", why="sink logits")


def _cache_blocks(b: Any, name: str, caches: int, kv_heads: int,
                  width: int) -> tuple[tuple[str, ...], int]:  # fmt: skip
    """(the semaphores, the bytes) of the aligned cache blocks around the new rows: `caches`
    arrays (GQA k and v, the MLA latent row) of `kv_heads` heads, rows `width` wide."""
    batch = b.dims.batch
    sems = b.block_sems(f"{name}_write_sems", (caches, batch, kv_heads))
    return sems, caches * batch * kv_heads * b.dims.cache_block * width * 2


def cache_read(b: Any, layer: int, name: str, caches: int, kv_heads: int, width: int) -> int:
    """The layer's first op: start reading the cache blocks (_cache_blocks) its cache write
    rewrites. They need only the positions, so they run under the layer's projections."""
    return b.read_block(layer, name, *_cache_blocks(b, name, caches, kv_heads, width))


def cache_write(b: Any, layer: int, name: str, caches: int, kv_heads: int, width: int,
                read: int, y: int) -> int:  # fmt: skip
    """The cache blocks (_cache_blocks) `read` started, the new rows `y` merged, written."""
    sems, nbytes = _cache_blocks(b, name, caches, kv_heads, width)
    return b.write_block(layer, name, sems, nbytes, read, y)


def tiles(b: Any, layer: int, name: str, wrote: int, q: int, n: int, tile_bytes: int,
          sems: list[tuple[str, ...]], flops: int) -> int:  # fmt: skip
    """One pair's KV tiles through two buffers under an online softmax."""
    res, hbm = f"{name}.tiles", f"hbm:{name}.cache"
    cslot = b.cache_slot(layer)
    nodes: dict[int, int] = {}
    state = {"prev": q}

    def tile(i: int, rep: int) -> int:
        return b.dma("kv_tile", f"L{layer} {name}: kv tile {i}", layer, res, i % 2,
                     sems[i % 2], tile_bytes, count=len(sems[i % 2]),
                     reads=((wrote, hbm, cslot),), repeat=rep)  # fmt: skip

    nodes[0] = tile(0, b.repeat)
    b.start(nodes[0])

    def body(i: int, last: bool, rep: Any) -> None:
        b.wait(nodes[i])
        if not last:
            nodes[i + 1] = tile(i + 1, rep(i + 1))
            b.start(nodes[i + 1])
        state["prev"] = b.run(
            "attention", f"L{layer} {name}: scores, online softmax, tile {i}", layer, flops,
            ((nodes[i], res, i % 2), (state["prev"], None, 0)),
        )  # fmt: skip

    b.loop(n, body)
    return state["prev"]
