"""Text nobody here wrote, for calibration and evaluation: the Python standard library's own source files, or
the user's files and folders.

Stdlib files are split by a hash of their path, so the calibration and evaluation sets never share a file, and
ordered by that hash, so ``calibration_texts(n)`` is the same n files on every machine with the same Python
version (the version is part of `corpus_description`). Texts come as ``{name: text}``: the names (paths
relative to the corpus root) are what a map or a results file records.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import platform
import sysconfig
import textwrap
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DataError

if TYPE_CHECKING:  # for annotations only: the tokenizer makes the tensors
    import torch

# One file in EVALUATION_SHARE goes to evaluation, by hash of its relative path.
EVALUATION_SHARE = 4
MIN_BYTES = 4000  # skip tiny files: contexts of 1-2k tokens need long files
SPLITS = ("calibration", "evaluation")
DATA_SUFFIXES = (".py", ".txt", ".md", ".rst")
_SKIPPED_PARTS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__", "ensurepip", "turtledemo",
                  "encodings"}  # encodings: codec tables, not prose or code


def stdlib_root() -> Path:
    """The running Python's standard library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def _key(relative: str) -> str:
    return hashlib.sha256(relative.encode()).hexdigest()


@lru_cache(maxsize=None)
def stdlib_files(split: str) -> tuple[Path, ...]:
    """Stdlib ``.py`` files of one split (``"calibration"`` or ``"evaluation"``), in a fixed hashed order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = stdlib_root()
    chosen = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if _SKIPPED_PARTS & set(relative.split("/")) or path.stat().st_size < MIN_BYTES:
            continue
        is_eval = int(_key(relative), 16) % EVALUATION_SHARE == 0
        if is_eval == (split == "evaluation"):
            chosen.append((_key(relative), path))
    return tuple(path for _, path in sorted(chosen))


def stdlib_texts(split: str, num_files: int, skip: int = 0) -> dict[str, str]:
    """``{relative path: text}`` of files ``skip .. skip + num_files`` of a stdlib split.

    Example:
        >>> len(stdlib_texts("calibration", 2))
        2
    """
    files = stdlib_files(split)
    if skip + num_files > len(files):
        raise ValueError(f"the {split} split has {len(files)} files, {skip + num_files} were asked for")
    root = stdlib_root()
    return {path.relative_to(root).as_posix(): path.read_text(encoding="utf-8", errors="replace")
            for path in files[skip: skip + num_files]}


def calibration_texts(num_files: int = 32) -> list[str]:
    """The first ``num_files`` calibration files' text."""
    return list(stdlib_texts("calibration", num_files).values())


def evaluation_texts(num_files: int = 20) -> list[str]:
    """The first ``num_files`` evaluation files' text (disjoint from every calibration file)."""
    return list(stdlib_texts("evaluation", num_files).values())


def corpus_description(split: str = "calibration", num_files: int | None = None) -> str:
    """One line saying what the corpus is, for map configs and cards."""
    files = stdlib_files(split)
    count = len(files) if num_files is None else num_files
    return (f"Python {platform.python_version()} standard library source, {split} split: {count} distinct files of "
            f"{len(files)} (>= {MIN_BYTES} bytes, tests excluded), ordered by sha256 of the path; 1 file in "
            f"{EVALUATION_SHARE} is held out for evaluation")


def read_texts(data: str, split: str, num_files: int | None, default_files: int = 32) -> tuple[dict[str, str], str]:
    """``({name: text}, description)`` for a ``--data`` argument: a text file, a folder of text files
    (``DATA_SUFFIXES``, sorted by path), or ``stdlib`` (the Python standard library corpus, ``split`` given).

    Example:
        >>> texts, description = read_texts("stdlib", "evaluation", 2)
        >>> len(texts)
        2
    """
    if data == "stdlib":
        count = num_files or default_files
        try:
            return stdlib_texts(split, count), corpus_description(split, count)
        except ValueError as err:
            raise DataError(f"--data stdlib: {err}") from None
    path = Path(data).expanduser()
    if path.is_file():
        return {path.name: path.read_text(encoding="utf-8", errors="replace")}, f"the text file {path.name}"
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in DATA_SUFFIXES and p.is_file())
        files = files[:num_files] if num_files else files
        if not files:
            raise DataError(f"--data {data}: the folder holds no {'/'.join(DATA_SUFFIXES)} files")
        texts = {p.relative_to(path).as_posix(): p.read_text(encoding="utf-8", errors="replace") for p in files}
        return texts, f"{len(files)} distinct files ({'/'.join(DATA_SUFFIXES)}) from the folder {path.name}"
    raise DataError(f"--data {data!r} is neither a file, a folder, nor 'stdlib'")


def token_ids(tokenizer, text: str, length: int | None = None) -> torch.Tensor:
    """The first ``length`` token ids of ``text`` (all of them without ``length``), ``[tokens]``, without the
    special tokens a tokenizer may add in front (a BOS): the text is cut where a model reading it would be.

    Example:
        >>> token_ids(tokenizer, "def f(x):\\n    return x", 4).shape   # doctest: +SKIP
        torch.Size([4])
    """
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0, :length]


def token_sequences(texts: Iterable[str], tokenizer, length: int, keep: int | None = None) -> list[torch.Tensor]:
    """The first ``keep`` (default ``length``) token ids of every text of ``texts`` that has at least ``length``,
    in order (shorter texts are skipped)."""
    sequences = []
    for text in texts:
        ids = token_ids(tokenizer, text)
        if ids.numel() >= length:
            sequences.append(ids[: keep or length])
    return sequences


# The task of the committed SmolLM2 adapters (scripts/train_adapters.py): a function without its docstring in,
# the docstring's first paragraph out.
DOCSTRING_INSTRUCTION = "Write the docstring of this Python function:\n```python\n{code}\n```"


def functions_with_docstrings(split: str, limit: int, max_code_chars: int = 400,
                              max_doc_chars: int = 200) -> list[tuple[str, str]]:
    """``(code without its docstring, first docstring paragraph)`` pairs from the stdlib files of ``split``."""
    pairs = []
    for path in stdlib_files(split):
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            first = node.body[0]
            if not doc or len(node.body) < 2:
                continue
            paragraph = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
            if len(paragraph) < 30:
                continue
            body = lines[node.lineno - 1 : first.lineno - 1] + lines[first.end_lineno : node.end_lineno]
            code = textwrap.dedent("\n".join(body)).strip()[:max_code_chars]
            pairs.append((code, paragraph[:max_doc_chars]))
            if len(pairs) >= limit:
                return pairs
    return pairs


def task_answer(task: str, docstring: str) -> str:
    """The answer of the committed adapters' tasks (scripts/train_adapters.py) for a function's ``docstring``: as it is
    (``docstring``), in capitals (``shout``, ``shout_alora``), or its words in reverse order (``reverse``).

    Example:
        >>> task_answer("reverse", "Return the sum.")
        'sum. the Return'
    """
    if task == "reverse":
        return " ".join(reversed(docstring.split()))
    return docstring.upper() if task.startswith("shout") else docstring


def docstring_chat(tokenizer, code: str, answer: str):
    """``(ids, labels)``: a chat asking for the docstring of ``code`` answered with ``answer``, in the tokenizer's
    chat template; the labels cover only the answer and its end token (-100 elsewhere)."""
    import torch

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": DOCSTRING_INSTRUCTION.format(code=code)}],
                                           tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    answer_ids = tokenizer(answer + (tokenizer.eos_token or ""), add_special_tokens=False).input_ids
    ids = torch.tensor(prompt_ids + answer_ids)
    labels = ids.clone()
    labels[: len(prompt_ids)] = -100
    return ids, labels


PROSE_ROOT = Path("/usr/share/doc/git")  # git's own documentation: prose that nobody here wrote, in every image


def prose_texts(num_files: int, skip: int = 0, min_bytes: int = 6000) -> dict[str, str]:
    """``{relative path: text}`` of documents ``skip .. skip + num_files`` of git's plain-text documentation
    (release notes, guides) of at least ``min_bytes``, ordered by sha256 of the path: text that is not Python, for
    evaluation only (never calibrated on).

    Example:
        >>> len(prose_texts(2)) == 2 or not PROSE_ROOT.is_dir()
        True
    """
    found = []
    for path in PROSE_ROOT.rglob("*.txt") if PROSE_ROOT.is_dir() else []:
        if path.is_file() and not path.is_symlink() and path.stat().st_size >= min_bytes:
            found.append((_key(path.relative_to(PROSE_ROOT).as_posix()), path))
    chosen = [path for _, path in sorted(found)][skip: skip + num_files]
    if len(chosen) < num_files:
        raise ValueError(f"{PROSE_ROOT} holds {len(found)} documents of >= {min_bytes} bytes, {skip + num_files} were "
                         "asked for")
    return {p.relative_to(PROSE_ROOT).as_posix(): p.read_text(encoding="utf-8", errors="replace") for p in chosen}
