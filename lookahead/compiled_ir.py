"""LLVM IR compiled for the host CPU with llvmlite, its object code cached on disk between processes.

Compiling the streamed kernel's module (`streamed_gemm`) takes ~0.15 s per weight type — optimisation passes
and code generation — in every process that generates, for a few kilobytes of machine code that only changes
with the IR, the CPU and llvmlite. So the object code is written to lookahead's cache folder
(`<cache>/kernels/`, named by a digest of the IR, the target triple, the CPU name and features and the llvmlite
version) and a later process loads it in ~3 ms instead. Each file holds a SHA-256 of the object code before it,
and a file that does not match (truncated, edited) is ignored and compiled again; writes go through a temporary
file and a rename, so a reader never sees a partial file. Any failure to read or write the cache only costs the
compile.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

from .paths import cache_dir

SUBDIR = "kernels"
_ENGINES: list = []  # compiled modules stay alive for the process (their code is called by address)


def compiled_address(ir: str, function: str, name: str = "module") -> int:
    """The address of `function` in the LLVM IR module `ir`, compiled for the host CPU at -O3 (or loaded from the
    disk cache; `name` labels the cached file). The code stays loaded for the life of the process."""
    return compiled_addresses(ir, (function,), name)[0]


def compiled_addresses(ir: str, functions: tuple[str, ...], name: str = "module") -> tuple[int, ...]:
    """The addresses of `functions` in the LLVM IR module `ir`, compiled once as `compiled_address` does."""
    import llvmlite.binding as llvm

    machine = _target_machine()
    path = _cache_path(ir, name, machine)
    cached = _read(path)
    module = llvm.parse_assembly(ir)
    module.verify()
    if cached is None:
        passes = llvm.create_pass_builder(machine, llvm.create_pipeline_tuning_options(speed_level=3))
        passes.getModulePassManager().run(module, passes)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.set_object_cache(notify_func=None if cached is not None else lambda _, code: _write(path, code),
                            getbuffer_func=lambda _: cached)
    engine.finalize_object()
    _ENGINES.append((engine, module))
    return tuple(engine.get_function_address(function) for function in functions)


@functools.cache
def host_features() -> str:
    """The host CPU's features as llvmlite reports them (e.g. "+avx2,+fma,…")."""
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_features().flatten()


@functools.cache
def _target_machine():
    """llvmlite's target machine for the host CPU at -O3 (native target initialised once)."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    llvm.initialize_native_asmparser()  # inline assembly (`affine_tiles`)
    return llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=host_features(), opt=3)


def _cache_path(ir: str, name: str, machine) -> Path | None:
    """Where the object code of `ir` for this machine and llvmlite lives (None when the cache folder is
    unusable)."""
    import llvmlite
    import llvmlite.binding as llvm

    key = "\n".join([ir, str(machine.triple), llvm.get_host_cpu_name(), host_features(), llvmlite.__version__])
    try:
        return cache_dir() / SUBDIR / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.o"
    except OSError:
        return None


def _read(path: Path | None) -> bytes | None:
    """The object code cached at `path` if the file is there and intact, else None."""
    try:
        data = path.read_bytes() if path is not None else b""
    except OSError:
        return None
    digest, code = data[:32], data[32:]
    return code if code and hashlib.sha256(code).digest() == digest else None


def _write(path: Path | None, code: bytes) -> None:
    """Cache `code` at `path` (digest first; atomically); failures are ignored."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as handle:
            handle.write(hashlib.sha256(code).digest() + code)
        os.replace(handle.name, path)
    except OSError:
        return


def call_codegen(integers: int, with_float: bool = False):
    """numba intrinsic codegen calling the compiled function at the first argument's address (numba has no
    call-by-address) with the other arguments: `integers` i64s, then a float if `with_float`; returns nothing."""
    from llvmlite import ir as llvm_ir

    def codegen(context, builder, signature, args):
        arguments = [llvm_ir.IntType(64)] * integers + ([llvm_ir.FloatType()] if with_float else [])
        function = llvm_ir.FunctionType(llvm_ir.VoidType(), arguments)
        builder.call(builder.inttoptr(args[0], function.as_pointer()), args[1:])
        return context.get_dummy_value()

    return codegen
