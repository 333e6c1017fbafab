"""The LiteRT generator's greedy steps skip sampling: its loop body sorts the
vocabulary (TOPK_V2, twice for top-k and top-p) only inside a branch (IF)
that a request with temperature 0 does not take. Computed in every step, the
two sorts were most of a step's time at batch 8 (docs/performance.md). The
tokens, greedy and sampled, stay the reference's
(tests/test_export_generator.py)."""

from __future__ import annotations

import pytest

from tests.test_generation import token_model

pytestmark = [
    pytest.mark.tensorflow_only("the generator's loop in a TensorFlow graph"),
    pytest.mark.slow,  # one LiteRT export (about 20 s)
]


def _operators(path: str) -> tuple[dict, list]:
    """The file's subgraphs: {name: [(operator name, options)]}, by index."""
    from ai_edge_litert import schema_py_generated as schema

    with open(path, "rb") as file:
        model = schema.ModelT.InitFromPackedBuf(file.read(), 0)
    names = {
        value: key
        for key, value in vars(schema.BuiltinOperator).items()
        if not key.startswith("_")
    }
    codes = [
        names[max(code.builtinCode, code.deprecatedBuiltinCode)]
        for code in model.operatorCodes
    ]
    subgraphs = [
        [(codes[op.opcodeIndex], op.builtinOptions) for op in subgraph.operators]
        for subgraph in model.subgraphs
    ]
    by_name = {s.name.decode(): i for i, s in enumerate(model.subgraphs)}
    return by_name, subgraphs


def _reached(subgraphs: list, index: int) -> set[int]:
    """`index` and the subgraphs its WHILE and IF operators run, transitively."""
    found = {index}
    for name, options in subgraphs[index]:
        if name == "IF":
            inner = (options.thenSubgraphIndex, options.elseSubgraphIndex)
        elif name == "WHILE":
            inner = (options.condSubgraphIndex, options.bodySubgraphIndex)
        else:
            continue
        for each in inner:
            found |= _reached(subgraphs, each)
    return found


def test_a_greedy_step_of_the_litert_generator_sorts_nothing(tmp_path):
    from keras_selfattn.export.generator import export_generator

    path = export_generator(
        token_model(), tmp_path / "lm.tflite", "litert", max_length=16, check=False
    )
    by_name, subgraphs = _operators(path)
    generate = subgraphs[by_name["generate"]]
    loops = [options for name, options in generate if name == "WHILE"]
    assert len(loops) == 1
    body = loops[0].bodySubgraphIndex
    names = [name for name, _ in subgraphs[body]]
    assert "TOPK_V2" not in names
    branches = [options for name, options in subgraphs[body] if name == "IF"]
    assert len(branches) == 1
    sampled = _reached(subgraphs, branches[0].thenSubgraphIndex)
    greedy = _reached(subgraphs, branches[0].elseSubgraphIndex)
    sorts = {
        i: sum(name == "TOPK_V2" for name, _ in subgraphs[i]) for i in sampled | greedy
    }
    assert sum(sorts[i] for i in sampled) == 2
    assert sum(sorts[i] for i in greedy) == 0
