#!/usr/bin/env python3
"""Build the experiment corpus from Debian packages: ~70 MB of real long-form text, ~20M GPT-2 tokens.

    python recipes/debian_corpus.py --out data/debian-gpt2            # then: foxlm train data=data/debian-gpt2

Needs Debian/Ubuntu's ``apt-get`` (packages are downloaded, never installed: ``apt-get download`` + ``dpkg-deb -x``)
and ``apt-get update`` done once (``--update`` runs it). Documents (one per file / book / novel):

- linux-doc-6.12: kernel documentation, ``Documentation/**/*.rst.gz`` (translations skipped)
- python3.11-doc: the Python docs' reStructuredText sources
- bible-kjv(-text): the King James Bible, one document per book, dumped with the package's own ``bible`` binary
- r-cran-janeaustenr: six Austen novels, decoded from R's ``Rdata.rdb`` (zlib blocks of serialized strings)
- vim-runtime: Vim's help files; perl-doc: Perl's ``.pod`` documentation

Long documents matter: FoX's claims are about positions in the thousands and beyond the training length.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

PACKAGES = ["linux-doc-6.12", "python3.11-doc", "bible-kjv", "bible-kjv-text", "r-cran-janeaustenr", "vim-runtime",
            "perl-doc"]
# in the folders this recipe makes under --work (root/, text/): it deletes and remakes only folders that hold it
MARKER = ".made-by-debian-corpus"


def foreign(path: Path) -> bool:
    """Whether something is at ``path`` that this recipe did not make (a folder without its marker, a file, a link)."""
    return os.path.lexists(path) and (path.is_symlink() or not (path / MARKER).is_file())


def fresh_folder(path: Path) -> Path:
    """An empty folder at ``path``, marked as this recipe's: one it made before is deleted first, anything else there
    refused (ValueError), never deleted."""
    if foreign(path):
        raise ValueError(f"--work: {path} was not made by this recipe, which would replace it; pass another --work "
                         f"(or move {path} away)")
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    (path / MARKER).touch()
    return path


def download(packages: list[str], work: Path) -> Path:
    """``apt-get download`` the packages into ``work/debs`` and extract them all into ``work/root``."""
    debs, root = work / "debs", work / "root"
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not list(debs.glob(f"{p}_*.deb"))]
    if missing:
        subprocess.run(["apt-get", "download", "-q", *missing], cwd=debs, check=True)
    fresh_folder(root)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def link_files(files: list[Path], dest: Path, base: Path) -> int:
    """Mirror ``files`` (paths under ``base``) into ``dest`` as symlinks; returns how many."""
    for f in files:
        target = dest / f.relative_to(base)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(f.resolve())
    return len(files)


def split_books(out: str) -> dict[str, str]:
    """The ``bible`` binary's output -> {book: text}: chapter headers ("Genesis 1", "1 Samuel 3") start chapters,
    verse numbers are stripped."""
    books: dict[str, list[str]] = {}
    book = None
    for line in out.splitlines():
        if m := re.fullmatch(r"(\S.*) (\d+)", line):
            book = m.group(1)
            books.setdefault(book, []).append(f"\nChapter {m.group(2)}\n" if books.get(book) else f"{book}\n")
        elif book is not None and line.strip():
            books[book].append(re.sub(r"^\s*\d+ ", "", line))
    return {name: "\n".join(lines) + "\n" for name, lines in books.items()}


def bible_books(root: Path, dest: Path) -> int:
    """The KJV through the package's binary, one file per book."""
    out = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-l100000", "gen1:1-rev22:21"],
                         capture_output=True, text=True, check=True).stdout
    books = split_books(out)
    for i, (name, text) in enumerate(books.items()):
        (dest / f"{i:02d}-{name.replace(' ', '-')}.txt").write_text(text)
    return len(books)


def _r_strings(blob: bytes) -> list[str]:
    """A character vector from R's XDR serialization (format 3): header, STRSXP, then CHARSXPs."""
    if blob[:2] != b"X\n":
        raise ValueError("not an R XDR serialization")
    pos = 2 + 12
    (version,) = struct.unpack(">i", blob[2:6])
    if version == 3:
        (n,) = struct.unpack(">i", blob[pos:pos + 4])
        pos += 4 + n
    flags, length = struct.unpack(">ii", blob[pos:pos + 8])
    if flags & 0xFF != 16:
        raise ValueError(f"expected a character vector (STRSXP), got SEXP type {flags & 0xFF}")
    pos += 8
    strings = []
    for _ in range(length):
        _, n = struct.unpack(">ii", blob[pos:pos + 8])
        pos += 8
        strings.append("" if n < 0 else blob[pos:pos + n].decode("utf-8"))
        pos += max(n, 0)
    return strings


def austen_novels(root: Path, dest: Path) -> int:
    """Six novels from janeaustenr's ``data/Rdata.rdb``: blocks of [u32 length][zlib stream]."""
    data = next(root.glob("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb")).read_bytes()
    pos, count = 0, 0
    while pos < len(data):
        d = zlib.decompressobj()
        blob = d.decompress(data[pos + 4:])
        pos = len(data) - len(d.unused_data)
        lines = _r_strings(blob)
        title = next(line for line in lines if line.strip())
        (dest / f"{count}-{re.sub(r'[^a-z]+', '-', title.lower()).strip('-')}.txt").write_text("\n".join(lines))
        count += 1
    return count


def collect(root: Path, text: Path) -> dict[str, int]:
    """Lay out one folder of documents per package under ``text``; returns document counts."""
    fresh_folder(text)
    counts = {}
    linux = next(root.glob("usr/share/doc/linux-doc-*/Documentation"))
    counts["linux-doc"] = link_files([p for p in sorted(linux.rglob("*.rst.gz"))
                                      if "translations" not in p.relative_to(linux).parts],
                                     text / "linux-doc", linux)
    pysrc = next(root.glob("usr/share/doc/python3*/html/_sources"))
    counts["python-doc"] = link_files(sorted(pysrc.rglob("*.rst.txt")), text / "python-doc", pysrc)
    vim = root / "usr/share/vim"
    counts["vim-doc"] = link_files(sorted(vim.glob("vim*/doc/*.txt")), text / "vim-doc", vim)
    perl = root / "usr"
    counts["perl-doc"] = link_files(sorted(perl.rglob("*.pod")), text / "perl-doc", perl)
    for name, fn in (("bible-kjv", bible_books), ("janeaustenr", austen_novels)):
        (text / name).mkdir(parents=True)
        counts[name] = fn(root, text / name)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output dataset folder (foxlm data prepare format)")
    p.add_argument("--work", default="build/debian-corpus", help="download/extract folder (kept for re-runs)")
    p.add_argument("--tokenizer", default="gpt2", help="tokenizer of the dataset (foxlm data prepare)")
    p.add_argument("--val-fraction", type=float, default=0.02, help="held-out share of the documents")
    p.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: the CPUs)")
    p.add_argument("--update", action="store_true", help="run apt-get update first")
    p.add_argument("--overwrite", action="store_true", help="replace the dataset in --out")
    args = p.parse_args(argv)

    from foxlm.cli import USER_ERRORS
    from foxlm.data.prepare import check_arguments, check_out_dir

    try:  # what prepare would refuse, before minutes of downloading
        check_arguments(val_fraction=args.val_fraction, workers=args.workers)
        check_out_dir(Path(os.path.abspath(Path(args.out).expanduser())), [], args.overwrite)
    except USER_ERRORS as e:
        print(f"debian_corpus.py: error: {e}", file=sys.stderr)
        return 2
    work = Path(args.work)
    taken = [str(p) for p in (work / "root", work / "text") if foreign(p)]
    if taken:
        print(f"--work: {' and '.join(taken)} exist and were not made by this recipe, which replaces them; pass "
              f"another --work (or move them away)", file=sys.stderr)
        return 2
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        print("this recipe needs apt-get and dpkg-deb (Debian/Ubuntu)", file=sys.stderr)
        return 2
    if args.update:
        subprocess.run(["apt-get", "update", "-qq"], check=True)
    unknown = [p for p in PACKAGES if subprocess.run(["apt-cache", "show", p], capture_output=True).returncode != 0]
    if unknown:
        hint = ("check that your apt sources hold them (Debian 13 / Ubuntu names)" if args.update else
                "run the recipe once with --update (apt-get update: this machine's package lists may be empty)")
        print(f"apt knows no package {', '.join(unknown)}: {hint}", file=sys.stderr)
        return 2
    root = download(PACKAGES, work)
    counts = collect(root, work / "text")
    print("documents per source:", counts, file=sys.stderr)

    from foxlm.data import prepare

    try:
        meta = prepare(sorted(p for p in (work / "text").iterdir() if p.is_dir()), args.out, tokenizer=args.tokenizer,
                       val_fraction=args.val_fraction, workers=args.workers, overwrite=args.overwrite)
    except USER_ERRORS as e:
        print(f"debian_corpus.py: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens "
          f"(train {meta['splits']['train']['num_tokens']:,}, val {meta['splits']['val']['num_tokens']:,}), "
          f"{meta['skipped']['count']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
