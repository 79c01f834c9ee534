"""The measurement scripts (``python benchmarks/bench_loader.py`` ...), as a regular package.

The repository root also holds ``benchmarks.py`` (YOLOv5's format benchmark). Without this file the folder
would be a namespace package, and in a folder that holds both a module and a namespace-package folder of the
same name Python imports the module: ``from benchmarks.bench_memory import cpu_name`` (the scripts here, and
the tests) would then find ``benchmarks.py`` and fail. A folder with ``__init__.py`` takes precedence over
the module, so ``benchmarks`` is this package and ``benchmarks.py`` runs only as a script.
"""
