"""mine/ mirrors solutions/: same public API, stubs raise NotImplementedError, no imports of solutions/."""

import ast

import pytest

from course.grader import registry

WRITTEN = [e for e in registry.written()]


def _surface(path) -> list[tuple]:
    """Top-level names in order, with signatures (args, defaults, annotations) and class members."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def sig(fn) -> tuple:
        return (fn.name, ast.unparse(fn.args), ast.unparse(fn.returns) if fn.returns else "",
                [ast.unparse(d) for d in fn.decorator_list])

    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(("def",) + sig(node))
        elif isinstance(node, ast.ClassDef):
            members = []
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.append(sig(item))
                elif isinstance(item, ast.AnnAssign):
                    members.append(("field", ast.unparse(item)))
            out.append(("class", node.name, [ast.unparse(b) for b in node.bases],
                        [ast.unparse(d) for d in node.decorator_list], members))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(("import", ast.unparse(node)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.append(("assign", [ast.unparse(t) for t in targets]))
    return out


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_stub_and_reference_expose_the_same_api(ex):
    mine, ref = _surface(ex.stub), _surface(ex.reference)
    assert mine == ref, f"{ex.id}: mine/ and solutions/ differ in their public surface"


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_stub_never_imports_solutions_and_has_tasks(ex):
    tree = ast.parse(ex.stub.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith(("solutions", "mine")), f"{ex.stub}: {ast.unparse(node)}"
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith(("solutions", "mine")) for a in node.names), ex.stub
    assert "raise NotImplementedError" in ex.stub.read_text(encoding="utf-8")
    assert "NotImplementedError" not in ex.reference.read_text(encoding="utf-8"), f"{ex.reference} is not implemented"


@pytest.mark.parametrize("ex", WRITTEN, ids=[e.id for e in WRITTEN])
def test_stub_task_bodies_are_only_docstring_and_raise(ex):
    """A function that differs from the reference must be a bare task: docstring + raise NotImplementedError."""
    ref_fns = dict(_functions(ast.parse(ex.reference.read_text(encoding="utf-8"))))
    for name, fn in _functions(ast.parse(ex.stub.read_text(encoding="utf-8"))):
        if name in ref_fns and ast.dump(fn) == ast.dump(ref_fns[name]):
            continue
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
        assert len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0]), \
            f"{ex.stub}: {fn.name} differs from the reference but is not a bare NotImplementedError task"
        assert ex.id in ast.unparse(body[0]), f"{ex.stub}: {fn.name}'s NotImplementedError should name {ex.id}"


def _functions(tree: ast.Module):
    """(qualified name, node) of every top-level function and method: `forward` of two classes differ."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def test_grading_environment_has_no_gpu_kernels():
    """HF swaps its pure-torch GatedDeltaNet functions for fla / causal_conv1d kernels when importable (G-13)."""
    import importlib.util
    for name in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(name) is None, f"{name} must not be importable in the grading environment"
