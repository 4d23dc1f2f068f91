"""The weight variants of an exported decoder, each in its own model folder with its own parity report.

    python -m scripts.prepare.quantize --quant int4          # build/model -> build/model-int4
    make model QUANT=int4                            # the same, after the fp32 export

Every variant is built on onnxruntime-genai's fused graph of the export's Hugging Face folder
(scripts/prepare/fused_graph.py), whose attention writes the KV cache in place (python_backend/engine/kv_slots.py):
one KV layout, with prefix caching and waiting batch rows, for every variant on the CPU. The export's own graph
(build/model, its padded cache) stays the reference and what the GPU runtimes serve (docs/architecture.md).
Weights only; activations and the KV cache stay fp32:
- fp32: the fused graph with the export's weights as they are: exact.
- int4: the layer matrices as 4-bit ``MatMulNBits`` (blocks of 32, asymmetric, fp32 compute: accuracy_level 1) on the
  grid the weights came from, plus a per-block residual that makes the product exact for GGUF Q4_1 weights
  (scripts/prepare/block_quantization.py); from a GGUF file, each tensor on its own grid (gguf_grid.py): its 5-, 6-
  and 8-bit ones as two 4-bit halves, its float ones fp32. The LM head stays fp32.
- fast: onnxruntime's own ``MatMulNBitsQuantizer``, 8 bits, blocks of 32, asymmetric, accuracy_level 4 (int8
  activations), LM head included (accuracy_level 1 has no fast 8-bit kernel on CPU: 2.8 tok/s, measured): the
  fastest, not exact. Chosen by measurement over int4 layers with an 8-bit head at accuracy_level 4 (docs/models.md);
  ``int8`` and ``int4-fast`` (the variants it replaced, on the export's graph) are its aliases.
- fp16: every matrix stored in fp16 (half the file) and widened to fp32 when onnxruntime loads it (a Cast of an
  initializer, folded at load): fp16's rounding of the weights, fp32's arithmetic and speed on the CPU.
A model the fused graph cannot take (sliding-window layers: fused_graph.refusal) gets fp32 and fp16 on the export's
own graph instead (its padded cache: no prefix caching), said in the build's log and the folder's settings; int4 and
fast are refused.
A variant on the fused graph also gets ``onnx/model.lora.onnx``: the same graph with LoRA adapter inputs on each
projection, reading the same weights file (scripts/prepare/lora_graph.py), which a server with adapters loads.
The choices (block size, symmetric or not, LM head, accuracy level) were made by measurement: docs/models.md,
docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from python_backend.model_files import ONNX_FILE, PARITY_REPORT_FILE, SETTINGS_FILE  # noqa: E402
from python_backend.lora import BaseShapes  # noqa: E402
from scripts.paths import EXPORT_DIR  # noqa: E402
from scripts.prepare import block_quantization, fused_graph, gguf_grid, lora_graph, source_grid  # noqa: E402
from scripts.prepare.build_marks import EXPORT_MARK, VARIANT_MARK, mark_complete, start_fresh, up_to_date  # noqa: E402
from scripts.prepare.variant_parity import (GENERATE_REFERENCE_FILE, GREEDY_REFERENCE_FILE,  # noqa: E402
                                          LOGIT_REFERENCE_FILE, check_variant)

FORMAT = 9  # bump when a recipe or the graph changes, so that `make model QUANT=...` builds the variant again (9: query_seqlens)
MS_DOMAIN = "com.microsoft"
# What quantize_on_grid made of each matrix (the parity report's "matrices": how -> source types -> matrices):
FILE_GRID = "4-bit on the GGUF file's own grid"
WIDE_GRID = "on the GGUF file's own 5-, 6- or 8-bit grid, as two 4-bit halves"
KEPT_FP32 = "kept fp32 (the file's type has no integer grid)"
SPLIT = "split into runs of columns, each on its own grid of the file or fp32"
MIN_MAX_GRID = "4-bit on each block's min and max"


@dataclass(frozen=True)
class Recipe:
    name: str
    bits: int | None = None  # None: the matrices are not quantized (stored as `dtype`)
    dtype: str = "fp32"  # the unquantized matrices' type: fp32, or fp16 (widened to fp32 at load)
    tool: str = "grid"  # "grid" (scripts/prepare/block_quantization.py) or "onnxruntime" (MatMulNBitsQuantizer)
    block_size: int = 32
    symmetric: bool = False
    accuracy_level: int = 1
    head_bits: int | None = None  # None: the LM head stays fp32
    residual: bool = True  # grid tool only


RECIPES = {
    "fp32": Recipe("fp32"),
    "int4": Recipe("int4", bits=4),
    "fast": Recipe("fast", bits=8, tool="onnxruntime", accuracy_level=4, head_bits=8),
    "fp16": Recipe("fp16", dtype="fp16"),
}
QUANT_CHOICES = tuple(RECIPES)
EXACT = ("fp32", "int4")  # a build whose parity fails is not kept (fast and fp16 only warn)
FUSED, EXPORT = "fused", "export"  # the graph a variant is built on (its settings' "graph")
ALIASES = {"int4-fast": "fast", "int8": "fast"}


def log(message: str) -> None:
    print(f"[quantize] {message}", file=sys.stderr, flush=True)


EXPORT_VARIANT = "export"  # the benchmarks' and tests' name for the export itself: fp32 on its own graph, padded cache


def variant_dir(base: Path, quant: str) -> Path:
    """Where `make model QUANT=...` puts a variant of the export at ``base`` ("export": the export itself)."""
    return base if quant == EXPORT_VARIANT else base.with_name(f"{base.name}-{quant}")


def constant_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    initializers = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in initializers]


def quantize_on_grid(model: onnx.ModelProto, recipe: Recipe, head: str | None,
                     grids: gguf_grid.FileGrids | None = None) -> dict:
    """Each constant MatMul -> MatMulNBits (+ block sums · residual, for asymmetric blocks). With a GGUF file's grids
    (gguf_grid.py), a matrix whose columns come from its 4-bit tensors keeps the file's own codes and scales, one from
    its 5-, 6- or 8-bit tensors the same as two 4-bit halves, one from its float tensors stays fp32, and one with
    columns of several kinds is split into runs of columns, each one kind, joined by a Concat. Returns statistics."""
    graph = GridGraph(model, recipe)
    replaced: dict[str, list[onnx.NodeProto]] = {}
    spreads = []
    made: dict[str, Counter] = {}  # what each matrix became -> the source tensor types of its columns -> matrices
    for node in constant_matmuls(model):
        is_head = node.name == head
        if is_head and recipe.head_bits is None:
            continue
        weight = numpy_helper.to_array(graph.initializers[node.input[1]])
        bits, symmetric = (recipe.head_bits, True) if is_head else (recipe.bits, recipe.symmetric)
        x, y = node.input[0], node.output[0]
        match = grids.match(weight) if grids is not None and bits == 4 and not is_head else None
        if match is None or match.missing:
            made.setdefault(MIN_MAX_GRID, Counter())["matrices"] += 1
            matrix = block_quantization.quantize(weight, bits, recipe.block_size, symmetric)
            spreads.append(matrix.residual_spread(weight))
            replaced[y] = graph.nbits(node.name, x, y, matrix, symmetric)
            continue
        runs = match.runs()
        layouts = {layout for _, layout in runs}
        if len(layouts) > 1:
            how = SPLIT
        elif layouts == {None}:
            how = KEPT_FP32
        else:
            how = FILE_GRID if layouts == {(4, gguf_grid.BLOCK)} else WIDE_GRID
        made.setdefault(how, Counter())["+".join(sorted(match.types))] += 1
        if how == KEPT_FP32:
            continue
        nodes, parts = [], []
        for i, (columns, layout) in enumerate(runs):
            name, part = (node.name, y) if len(runs) == 1 else (f"{node.name}.part{i}", f"{y}.part{i}")
            if layout is None:
                nodes += graph.dense(name, x, part, weight[:, columns])
            else:
                grid = match.grid_of(columns)
                nodes += graph.on_grid(name, x, part, grid, weight[:, columns], spreads)
            parts.append(part)
        if len(runs) > 1:
            nodes.append(helper.make_node("Concat", parts, [y], name=f"{node.name}.columns", axis=-1))
        replaced[y] = nodes  # output names are unique in a graph; node names need not be
    rebuilt = []
    for node in model.graph.node:
        rebuilt += replaced.get(node.output[0], [node]) if node.output else [node]
    del model.graph.node[:]
    model.graph.node.extend(rebuilt)
    _use_ms_domain(model)
    return {"matmuls_quantized": len(replaced), "max_residual_spread": max(spreads, default=0.0),
            "matrices": {how: dict(counts) for how, counts in made.items()}}


class GridGraph:
    """The nodes and initializers that replace a graph's MatMuls; an input's block sums are computed once for all the
    matrices it multiplies."""

    def __init__(self, model: onnx.ModelProto, recipe: Recipe):
        self.graph, self.recipe = model.graph, recipe
        self.initializers = {i.name: i for i in model.graph.initializer}
        self.block_sums: dict[tuple[str, int], str] = {}  # (input, block size) -> its block sums

    def add(self, name: str, value: np.ndarray) -> str:
        self.initializers[name] = numpy_helper.from_array(value, name)
        self.graph.initializer.append(self.initializers[name])
        return name

    def dense(self, name: str, x: str, y: str, weight: np.ndarray) -> list[onnx.NodeProto]:
        return [helper.make_node("MatMul", [x, self.add(f"{name}.weight", np.ascontiguousarray(weight))], [y],
                                 name=name)]

    def on_grid(self, name: str, x: str, y: str, grid: gguf_grid.Grid, weight: np.ndarray,
                spreads: list[float]) -> list[onnx.NodeProto]:
        """A GGUF grid's matrix: one 4-bit MatMulNBits, or the sum of two for codes of 5, 6 or 8 bits."""
        if grid.bits == 4:
            matrix = block_quantization.from_grid(grid.codes, grid.scales, grid.offsets, grid.block)
            spreads.append(matrix.residual_spread(weight))
            return self.nbits(name, x, y, matrix, symmetric=False)
        high, low = block_quantization.halves(grid.codes, grid.scales, grid.offsets, grid.block)
        spreads.append(low.residual_spread(weight - high.dequantize()))
        return (self.nbits(f"{name}.high", x, f"{y}.high", high, symmetric=False)
                + self.nbits(f"{name}.low", x, f"{y}.low", low, symmetric=False)
                + [helper.make_node("Add", [f"{y}.high", f"{y}.low"], [y], name=f"{name}.halves")])

    def nbits(self, name: str, x: str, y: str, matrix: block_quantization.QuantizedMatrix,
              symmetric: bool) -> list[onnx.NodeProto]:
        recipe = self.recipe
        k, n = matrix.shape
        inputs = [x, self.add(f"{name}.q{matrix.bits}", matrix.packed), self.add(f"{name}.scales", matrix.scales)]
        if matrix.zero_points is not None:
            inputs.append(self.add(f"{name}.zero_points", matrix.zero_points))
        with_residual = recipe.residual and not symmetric and bool(matrix.residual.any())
        nodes = [helper.make_node("MatMulNBits", inputs, [f"{y}.blocks" if with_residual else y],
                                  name=f"{name}.nbits", domain=MS_DOMAIN, K=k, N=n, bits=matrix.bits,
                                  block_size=matrix.block_size, accuracy_level=recipe.accuracy_level)]
        if with_residual:
            sums = self.block_sums.get((x, matrix.block_size))
            if sums is None:
                sums_matrix = f"block_sums.{k}x{matrix.block_size}"
                if sums_matrix not in self.initializers:
                    self.add(sums_matrix, block_quantization.block_sum_matrix(k, matrix.block_size))
                sums = self.block_sums[(x, matrix.block_size)] = f"{x}.block_sums{matrix.block_size}"
                nodes.insert(0, helper.make_node("MatMul", [x, sums_matrix], [sums], name=f"{name}.block_sums"))
            nodes += [helper.make_node("MatMul", [sums, self.add(f"{name}.residual", matrix.residual)],
                                       [f"{y}.residual"], name=f"{name}.residual"),
                      helper.make_node("Add", [f"{y}.blocks", f"{y}.residual"], [y], name=f"{name}.exact")]
        return nodes


def quantize_with_onnxruntime(model: onnx.ModelProto, recipe: Recipe, head: str | None) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=recipe.block_size, is_symmetric=recipe.symmetric,
                                          accuracy_level=recipe.accuracy_level, bits=recipe.bits)
    exclude = [head] if head and recipe.head_bits is None else []
    quantizer = MatMulNBitsQuantizer(model, algo_config=config, nodes_to_exclude=exclude)
    quantizer.process()
    return quantizer.model.model


def fp16_matrices(model: onnx.ModelProto) -> int:
    """Stores every fp32 matrix (an initializer of two or more dimensions) as fp16, read through a Cast to fp32 under
    its old name: onnxruntime folds the Cast when it loads the graph, so the graph computes in fp32 (onnxruntime's CPU
    provider has no fp16 MatMul) on fp16-rounded weights, and the in-place KV cache and every other tensor keep their
    types. Returns the number of matrices."""
    graph = model.graph
    casts, kept = [], []
    for initializer in graph.initializer:
        if initializer.data_type != onnx.TensorProto.FLOAT or len(initializer.dims) < 2:
            kept.append(initializer)
            continue
        name = initializer.name
        half = numpy_helper.from_array(numpy_helper.to_array(initializer).astype(np.float16), f"{name}.fp16")
        kept.append(half)
        casts.append(helper.make_node("Cast", [half.name], [name], name=f"{name}.to_fp32", to=onnx.TensorProto.FLOAT))
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return len(casts)


def build_variant(source: Path, output: Path, recipe: Recipe, graph: str = FUSED) -> dict:
    """Writes output/onnx/model.onnx (+ data) from source's, on the fused graph or the export's; returns the build
    statistics."""
    stats: dict = {"graph": graph}
    if graph == FUSED:
        weights = source_weights(source)
        log(f"{recipe.name}: onnxruntime-genai's fused graph of {weights}")
        model = fused_graph.build(weights)
        head = fused_graph.lm_head(model)
    else:
        log(f"{recipe.name}: the export's own graph, {source / ONNX_FILE}")
        model, head = onnx.load(str(source / ONNX_FILE)), None
    if recipe.bits is None:
        if recipe.dtype == "fp16":
            stats["matrices_fp16"] = fp16_matrices(model)
    else:
        if recipe.tool == "onnxruntime":
            model = quantize_with_onnxruntime(model, recipe, head)
        else:
            stats.update(quantize_on_grid(model, recipe, head, source_file_grids(source)))
        _drop_unused_initializers(model)
    onnx_path = output / ONNX_FILE
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(onnx_path), save_as_external_data=True, location=onnx_path.name + ".data")
    stats["model_bytes"] = sum(p.stat().st_size for p in onnx_path.parent.iterdir())
    shapes = lora_shapes(source) if graph == FUSED else None
    if shapes is not None:  # LoRA adapters per row: the same graph with adapter inputs, on the same weights file
        lora_graph.write_adapter_graph(output, shapes)
    return stats


@functools.lru_cache(maxsize=8)
def lora_shapes(source: Path) -> BaseShapes | None:
    """The projections' shapes a LoRA adapter is checked against, from the source's config (None, said once, when the
    config does not name them: the variant then serves no adapters)."""
    try:
        return BaseShapes.from_config(json.loads((source_weights(source) / "config.json").read_text()))
    except KeyError as missing:
        log(f"no LoRA adapters for {source}: its config names no {missing}")
        return None


def variant_graph(source: Path, recipe: Recipe) -> tuple[str, str]:
    """The graph a variant is built on, and why. The fused graph, except for fp32 and fp16 of a model it would not
    compute as the model does over its whole context (sliding-window layers, which it refuses; a window it leaves
    out, which would cap the context at the window): those keep the model's answers and context on the export's own
    graph, without prefix caching. (int4 and fast are refused or capped instead.)"""
    weights = source_weights(source)
    if recipe.bits is None:
        if why := fused_graph.refusal(weights, recipe.name):
            return EXPORT, f"the fused graph cannot take this model: {why}"
        window = fused_graph.unwindowed_limit(weights)
        context = json.loads((source / SETTINGS_FILE).read_text())["max_position_embeddings"]
        if window is not None and window < context:
            return EXPORT, (f"the fused graph leaves out the model's sliding window: it would cap the context at "
                            f"{window} of {context} tokens")
    return FUSED, "the fused graph: one KV layout, written in place, with prefix caching"


def source_gguf(source: Path) -> Path | None:
    """The GGUF file the export at ``source`` was made from, if it was one and is still there."""
    path = Path(json.loads((source / SETTINGS_FILE).read_text()).get("source", ""))
    return path if path.suffix == ".gguf" and path.is_file() else None


def source_file_grids(source: Path) -> gguf_grid.FileGrids | None:
    path = source_gguf(source)
    if path is None:
        return None
    grids = gguf_grid.FileGrids(path)
    log(f"{path.name}: layer tensors " + ", ".join(f"{n} {kind}" for kind, n in grids.types.most_common())
        + f"; the {'/'.join(gguf_grid.ON_GRID)} ones keep their own grid (those of 5, 6 or 8 bits as two 4-bit "
        "halves), the others stay fp32")
    return grids


def source_weights(source: Path) -> Path:
    """The Hugging Face folder the export was made from: its own hf/ for a GGUF (dequantized there), else the folder
    its settings name (a Hugging Face source is read where it is, not copied). The builder takes a path that does
    not exist for a model hub's name, so a missing folder is refused here."""
    weights = source / "hf"
    if not weights.is_dir():
        weights = Path(json.loads((source / SETTINGS_FILE).read_text())["hf_dir"])
    if not (weights / "config.json").is_file():
        raise SystemExit(f"the weights {source} was exported from are not at {weights} any more: export it again "
                         "(make model SOURCE=...)")
    return weights


def copy_model_files(source: Path, output: Path, recipe: Recipe, graph: str = FUSED) -> None:
    """Tokenizer and settings from the fp32 export; settings say which variant this is, and on which graph."""
    own_files = {PARITY_REPORT_FILE, SETTINGS_FILE, EXPORT_MARK, GREEDY_REFERENCE_FILE, LOGIT_REFERENCE_FILE,
                 GENERATE_REFERENCE_FILE}
    for item in source.iterdir():
        if item.is_file() and item.name not in own_files:
            shutil.copy2(item, output / item.name)
    settings = json.loads((source / SETTINGS_FILE).read_text())
    settings["quantization"] = recipe.name
    settings["quantization_recipe"] = asdict(recipe)
    settings["graph"] = graph
    shapes = lora_shapes(source) if graph == FUSED else None
    if shapes is not None:  # what a LoRA adapter is checked against (python_backend/lora.py)
        settings["lora_base"] = shapes.to_json()
    window = fused_graph.unwindowed_limit(source_weights(source)) if graph == FUSED else None
    if window is not None and window < settings["max_position_embeddings"]:
        # The engine caps prompt + max_tokens at this: no sequence outgrows the window the fused graph leaves out.
        log(f"{recipe.name}: contexts capped at the model's sliding window, {window} tokens (the fused graph attends "
            "to the whole sequence, the model to its window)")
        settings["max_position_embeddings"] = window
        settings["context_capped_by"] = f"sliding_window {window}"
    (output / SETTINGS_FILE).write_text(json.dumps(settings, indent=2))


def _use_ms_domain(model: onnx.ModelProto) -> None:
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    kept = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def fingerprint(source: Path, recipe: Recipe) -> dict:
    export = json.loads((source / EXPORT_MARK).read_text())
    return {"export": export, "recipe": asdict(recipe), "format": FORMAT}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quant", required=True, choices=[*QUANT_CHOICES, *ALIASES])
    parser.add_argument("--source", type=Path, default=EXPORT_DIR, help="the fp32 export (make model)")
    parser.add_argument("--output", type=Path, help="default: <source>-<quant>")
    parser.add_argument("--force", action="store_true", help="build again even if the output is up to date")
    parser.add_argument("--keep-inexact", action="store_true",
                        help="keep an exact variant (int4) whose parity fails, as a model of its own (not exact)")
    args = parser.parse_args(argv)
    if args.quant in ALIASES:
        log(f"{args.quant} is now called {ALIASES[args.quant]}")
        args.quant = ALIASES[args.quant]
    if not (args.source / EXPORT_MARK).is_file():
        parser.error(f"{args.source} is not a complete export; run `make model` (scripts/prepare/export_onnx.py) first")
    recipe = RECIPES[args.quant]
    output = args.output or variant_dir(args.source, args.quant)
    wanted = fingerprint(args.source, recipe)
    if not args.force and up_to_date(output, VARIANT_MARK, wanted):
        log(f"{output} is up to date; skipping (use --force to redo)")
        return 0
    if recipe.bits == 4 and not args.keep_inexact:  # before minutes of work, not after its parity check
        settings = json.loads((args.source / SETTINGS_FILE).read_text())
        why = source_grid.refusal(source_weights(args.source), settings.get("source", ""), recipe.name,
                                  recipe.bits, recipe.block_size)
        if why:
            log(why)
            return 1
    if recipe.bits is not None and (why := fused_graph.refusal(source_weights(args.source), recipe.name)):
        log(why)
        return 1
    graph, why = variant_graph(args.source, recipe)
    if graph == EXPORT:
        log(f"{recipe.name}: built on the export's own graph (its padded cache: no prefix caching), as {why}")
    start_fresh(output)
    started = time.monotonic()
    stats = build_variant(args.source, output, recipe, graph)
    copy_model_files(args.source, output, recipe, graph)
    log(f"{recipe.name}: {stats['model_bytes'] / 1e6:.0f} MB in {time.monotonic() - started:.0f} s; checking parity")

    report = check_variant(args.source, output, recipe.name, stats)
    if not report["passed"] and recipe.name in EXACT and not args.keep_inexact:
        # Not left behind to be served as if it were exact: the weights go, the report stays, no completion mark.
        shutil.rmtree((output / ONNX_FILE).parent)
        g = report["greedy_agreement"]
        log(f"{recipe.name} is not exact for this model (max |Δ logits| {report['max_abs_logit_diff']:.3g}, greedy "
            f"identical on {g['identical']} of {g['prompts']} prompts; the report: {output / PARITY_REPORT_FILE}), "
            f"so it was not kept. Serve {'QUANT=fp32 or ' if recipe.name != 'fp32' else ''}the export itself "
            f"(MODEL_DIR={args.source}), or build it anyway with --keep-inexact")
        return 1
    if not report["passed"]:  # the thresholds are the default model's (make test); another model may differ
        log(f"WARNING: parity below the thresholds set for the default model: see {output / PARITY_REPORT_FILE}")
    mark_complete(output, VARIANT_MARK, wanted)
    log(f"done: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
