#!/usr/bin/env python3
"""Checks that anneal's layers only call the layers below them.

Three checks, each printing every violation it finds (exit 1 if any):

1. includes: a file under src/<folder>/ includes only
   - public headers include/anneal/<h>.h of its own layer or a lower one, and
   - private headers of its own folder ("x.h", "<folder>/x.h"), never another
     folder's private header;
   and a public header includes only public headers of its own layer or lower ones.
2. symbols (needs the build's object files): an object of layer L references no
   symbol defined by an object of a higher layer (e.g. core calling the CPU backend).
3. cycles: no two object files of the library reference each other's symbols,
   except the pairs listed in ALLOWED_CYCLES (one unit split across files).

4. names (with the objects): every global symbol the library defines starts with
   anneal_ (what the compiler makes for them excepted: OpenMP's locks for named
   critical sections, AddressSanitizer's ODR markers), and a trailing underscore means one thing: the function works in place
   (IN_PLACE lists them); library-internal functions shared between files are
   declared in a folder's *_internal.h and named like public ones.

Usage: check_layers.py SOURCE_DIR [OBJECT_DIR]
       check_layers.py --self-test   (builds a small tree with one violation of each
                                      kind and checks that each is reported)
OBJECT_DIR is the directory holding the library's objects (CMake:
<build>/CMakeFiles/anneal.dir); without it only the include check runs.
"""
import os
import re
import subprocess
import sys

# Lowest first: each layer may use its own and the ones before it.
LAYERS = ["core", "backends", "autograd", "ops", "nn", "models", "parallel", "optim",
          "data", "io", "obs", "train", "serve", "cli"]
# Source folders and the layer each belongs to.
FOLDERS = {"core": "core", "cpu": "backends", "cuda": "backends", "backends": "backends",
           "autograd": "autograd", "ops": "ops", "nn": "nn", "models": "models",
           "parallel": "parallel", "optim": "optim", "data": "data", "io": "io",
           "obs": "obs", "train": "train", "serve": "serve", "cli": "cli"}
# Public headers and their layers (anneal.h, the umbrella, is the top).
# backend.h is the device interface: core keeps the registry of tables, backends
# implement it, ops call through it; so it is a core header.
HEADERS = {"core": "core", "cuda": "backends", "fs": "core", "parse": "core", "backend": "core", "trace": "core", "decode_kernels": "backends", "profile": "obs", "autograd": "autograd",
           "ops": "ops", "custom_op": "ops", "nn": "nn", "onnx": "nn", "model": "models", "models": "models",
           "gpt2": "models", "parallel": "parallel", "optim": "optim", "data": "data",
           "tokenizer": "data", "shard": "data", "loader": "data", "prepare": "data",
           "bpe": "data", "io": "io", "checkpoint": "io", "peft": "io", "gguf": "io", "obs": "obs", "telemetry": "obs",
           "train": "train", "serve": "serve",
           "anneal": "cli"}
# Deliberate exceptions, each with its reason: (from layer, to layer, symbol).
ALLOWED_SYMBOLS = {
    # SQLite's sqlite3_os_init pattern: core declares the hook that registers the
    # built-in backends and calls it once on the first lookup of an unregistered
    # device; src/backends/registry.c defines it (one line per backend). core names
    # no backend.
    ("core", "backends", "anneal_backends_register_builtin"),
}

# Pairs of objects that may reference each other: one idea split over two files.
ALLOWED_CYCLES = {
    ("core/scope.c.o", "core/tensor.c.o"),  # scopes own tensors; tensors register with scopes
    ("cpu/attention.c.o", "cpu/attention_bf16.c.o"),  # task drivers shared by the f32/bf16 kernels
    ("cpu/attention_avx512bf16.c.o", "cpu/attention_bf16.c.o"),
    ("cpu/gemm_avx2.c.o", "cpu/gemm_precision.c.o"),  # operand rounding used while packing
    ("parallel/comm.c.o", "parallel/comm_mpi.c.o"),  # the dispatcher and its MPI implementation
    ("parallel/comm.c.o", "parallel/comm_nccl.c.o"),  # the dispatcher and its NCCL implementation
}

# The functions whose trailing underscore says they write their first argument in place.
IN_PLACE = {"anneal_copy_", "anneal_init_fill_", "anneal_init_normal_", "anneal_init_uniform_"}

INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def rank(layer):
    return LAYERS.index(layer)


def registered_backend_folders(src_root):
    """src/<name>/ of every backend registered in src/backends/registry.c
    (X(anneal_<name>_backend_register)): a backend's registration line also says
    where it sits, so a new backend folder needs no line here."""
    path = os.path.join(src_root, "src", "backends", "registry.c")
    if not os.path.exists(path):
        return {}
    text = open(path, encoding="utf-8").read()
    return {n: "backends" for n in re.findall(r"X\(anneal_([a-z0-9_]+)_backend_register\)", text)}


def check_includes(src_root):
    FOLDERS.update(registered_backend_folders(src_root))
    errors = []
    for folder in sorted(os.listdir(os.path.join(src_root, "src"))):
        path = os.path.join(src_root, "src", folder)
        if not os.path.isdir(path):
            continue
        layer = FOLDERS.get(folder)
        if layer is None:
            errors.append(f"src/{folder}/: a folder without a layer (add it to check_layers.py "
                          f"and docs/ARCHITECTURE.md)")
            continue
        for name in sorted(os.listdir(path)):
            if not name.endswith((".c", ".h")):
                continue
            text = open(os.path.join(path, name), encoding="utf-8", errors="replace").read()
            for inc in INCLUDE_RE.findall(text):
                where = f"src/{folder}/{name}: #include \"{inc}\""
                if inc.startswith("anneal/"):
                    hdr = inc[len("anneal/"):-2]
                    hl = HEADERS.get(hdr)
                    if hl is None:
                        errors.append(f"{where}: unknown public header (give it a layer)")
                    elif rank(hl) > rank(layer):
                        errors.append(f"{where}: layer {layer} includes a header of the higher "
                                      f"layer {hl}")
                elif "/" in inc:
                    if inc.startswith("../"):
                        inc = os.path.normpath(os.path.join(folder, inc))
                    other = inc.split("/")[0]
                    if other != folder:
                        errors.append(f"{where}: a private header of another folder "
                                      f"(src/{other}/)")
    inc_dir = os.path.join(src_root, "include", "anneal")
    for name in sorted(os.listdir(inc_dir)):
        hl = HEADERS.get(name[:-2])
        if hl is None:
            errors.append(f"include/anneal/{name}: unknown public header (give it a layer)")
            continue
        text = open(os.path.join(inc_dir, name), encoding="utf-8").read()
        for inc in INCLUDE_RE.findall(text):
            il = HEADERS.get(inc[len("anneal/"):-2]) if inc.startswith("anneal/") else None
            if il is None:
                errors.append(f"include/anneal/{name}: #include \"{inc}\" is not a public header")
            elif rank(il) > rank(hl):
                errors.append(f"include/anneal/{name} ({hl}): includes {inc} of the higher "
                              f"layer {il}")
    return errors


def object_symbols(src_root, obj_root):
    """{object path relative to obj_root/src: (folder, defined set, undefined set)} for the
    objects whose source file still exists (a build directory keeps stale ones)."""
    objs = {}
    src = os.path.join(obj_root, "src")
    for folder in sorted(os.listdir(src)):
        for dirpath, _, files in os.walk(os.path.join(src, folder)):
            for f in files:
                if not f.endswith(".o"):
                    continue
                p = os.path.join(dirpath, f)
                if not os.path.exists(os.path.join(src_root, "src", os.path.relpath(p, src)[:-2])):
                    continue
                out = subprocess.run(["nm", "-g", "-P", p], capture_output=True, text=True,
                                     check=True).stdout
                defined, undefined = set(), set()
                for line in out.splitlines():
                    parts = line.split()
                    if len(parts) < 2:
                        continue
                    sym, kind = parts[0], parts[1]
                    if kind == "U":
                        undefined.add(sym)
                    elif kind in "TDBRVWCGSiu":  # -g: global symbols only
                        if f.endswith(".cu.o") and (kind in "VWu" or "_GLOBAL__N_" in sym):
                            # CUDA C++: weak or unique symbols are the toolkit headers' template
                            # instances and inline variables (CUB, NVTX, libcu++), merged by the
                            # linker; names in anonymous namespaces (and their launch stubs) are
                            # per file, though nvcc marks them global
                            continue
                        defined.add(sym)
                objs[os.path.relpath(p, src)] = (folder, defined, undefined)
    return objs


def check_symbols(src_root, obj_root):
    errors = []
    objs = object_symbols(src_root, obj_root)
    owner = {}
    for name, (folder, defined, _) in objs.items():
        for s in defined:
            owner[s] = name
    refs = {}
    for name, (folder, _, undefined) in objs.items():
        layer = FOLDERS.get(folder)
        for s in sorted(undefined):
            other = owner.get(s)
            if other is None or other == name:
                continue
            refs.setdefault(name, set()).add(other)
            ol = FOLDERS.get(objs[other][0])
            if layer and ol and rank(ol) > rank(layer) and (layer, ol, s) not in ALLOWED_SYMBOLS:
                errors.append(f"{name} ({layer}) calls {s} of {other} ({ol}): a higher layer")
    for name, (folder, defined, _) in objs.items():
        for sym in sorted(defined):
            if sym.startswith((".gomp_critical_user_anneal_", "__odr_asan.anneal_", "__asan_")):
                continue  # made by the compiler: OpenMP's named-critical locks, ASan's ODR markers
            if not sym.startswith("anneal_"):
                errors.append(f"{name}: global symbol {sym} lacks the anneal_ prefix (make it static or "
                              f"prefix it)")
            elif sym.endswith("_") and sym not in IN_PLACE:
                errors.append(f"{name}: {sym} ends in '_', which means 'in place' (IN_PLACE) only")
    seen = set()
    for a, targets in refs.items():
        for b in targets:
            if a in refs.get(b, ()) and (b, a) not in seen:
                seen.add((a, b))
                if (a, b) in ALLOWED_CYCLES or (b, a) in ALLOWED_CYCLES:
                    continue
                errors.append(f"{a} and {b} reference each other's symbols (a cycle)")
    return errors


def self_test():
    """A negative control: every kind of violation in a scratch tree must be reported."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        def write(rel, text):
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            open(os.path.join(d, rel), "w").write(text)
        write("include/anneal/core.h", "")
        write("include/anneal/ops.h", '#include "anneal/core.h"\n')
        write("include/anneal/optim.h", '#include "anneal/ops.h"\n')
        write("include/anneal/backend.h", '#include "anneal/optim.h"\n')  # core header -> optim
        write("src/core/a.c", '#include "anneal/ops.h"\nvoid anneal_cpu_k(void);\n'
              'void anneal_core_a(void) { anneal_cpu_k(); }\nvoid helper(void) {}\n'
              'void anneal_private_(void) {}\n')
        write("src/cpu/b.c", '#include "core/core_internal.h"\nvoid anneal_core_a(void);\n'
              'void anneal_cpu_k(void) { anneal_core_a(); }\n')
        write("src/core/core_internal.h", "")
        obj = os.path.join(d, "obj")
        for rel in ("src/core/a.c", "src/cpu/b.c"):
            os.makedirs(os.path.join(obj, os.path.dirname(rel)), exist_ok=True)
            subprocess.run(["cc", "-c", "-I", os.path.join(d, "include"), "-I", os.path.join(d, "src"),
                            os.path.join(d, rel), "-o", os.path.join(obj, rel + ".o")], check=True)
        errors = check_includes(d) + check_symbols(d, obj)
    want = ["src/core/a.c: #include \"anneal/ops.h\": layer core includes",
            "src/cpu/b.c: #include \"core/core_internal.h\": a private header of another folder",
            "include/anneal/backend.h (core): includes anneal/optim.h",
            "core/a.c.o (core) calls anneal_cpu_k of cpu/b.c.o (backends)",
            "reference each other's symbols (a cycle)",
            "global symbol helper lacks the anneal_ prefix",
            "anneal_private_ ends in '_'"]
    missing = [w for w in want if not any(w in e for e in errors)]
    for m in missing:
        print("check_layers self-test: not reported:", m)
    print(f"check_layers self-test: {len(want) - len(missing)} of {len(want)} violations reported")
    return 1 if missing else 0


def main():
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        return self_test()
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    errors = check_includes(sys.argv[1])
    if len(sys.argv) > 2:
        errors += check_symbols(sys.argv[1], sys.argv[2])
    for e in errors:
        print("layers:", e)
    print(f"check_layers: {len(errors)} violation(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
