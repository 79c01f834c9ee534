"""Dependencies between the project's modules run one way: no two modules import each other, not even inside a
function or under ``__main__`` (``python models/yolo.py`` would load yolo.py twice, once as __main__)."""
from __future__ import annotations

import ast

from tests.conftest import ROOT, fresh_python


def project_modules() -> dict:
    modules = {}
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in ("tests", "runs") or any(part.startswith(".") for part in relative.parts):
            continue
        modules[".".join(relative.with_suffix("").parts).removesuffix(".__init__")] = path
    return modules


def imports(path, modules: dict) -> set:
    """The project modules ``path`` imports anywhere in the file (``from a import b`` counts a.b when b is one)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in modules}


def test_no_two_modules_import_each_other():
    modules = project_modules()
    graph = {name: imports(path, modules) - {name} for name, path in modules.items()}
    mutual = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph[b]})
    assert mutual == []


def test_models_yolo_as_a_script_is_loaded_once():
    code = ("import runpy, sys\n"
            "sys.argv = ['models/yolo.py', '--cfg', 'yolov5n.yaml', '--imgsz', '64']\n"
            "try:\n    runpy.run_path('models/yolo.py', run_name='__main__')\n"
            "except SystemExit as end:\n    assert end.code == 0, end.code\n"
            "print('models.yolo' in sys.modules)\n")
    assert fresh_python(code, timeout=300)[-1] == "False"
