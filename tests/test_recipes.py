"""recipes/debian_corpus.py: its decoders on inputs written in the packages' formats, then on the real packages."""

from __future__ import annotations

import importlib.util
import random
import shutil
import socket
import struct
import subprocess
import urllib.parse
import zlib
from pathlib import Path

import pytest

WORDS = ["forget", "gate", "attention", "Emma", "Darcy", "Samuel", "light", "waters", "caf\u00e9", "\u2019tis", "42"]


@pytest.fixture(scope="module")
def recipe():
    script = Path(__file__).parents[1] / "recipes/debian_corpus.py"
    spec = importlib.util.spec_from_file_location("debian_corpus", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _line(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))


def _r_character_vector(strings: list[str | None]) -> bytes:
    """R's XDR serialization, format 3, of a character vector (None: NA), as lazy-load databases hold it."""
    out = b"X\n" + struct.pack(">iii", 3, 0x040300, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
    out += struct.pack(">ii", 16, len(strings))  # STRSXP
    for s in strings:
        data = b"" if s is None else s.encode()
        out += struct.pack(">ii", 0x8009, -1 if s is None else len(data)) + data  # CHARSXP, UTF-8 flag
    return out


def test_r_strings_decode_a_character_vector_and_refuse_other_objects(recipe):
    rng = random.Random()
    strings = [_line(rng) for _ in range(rng.randint(1, 50))] + [None, ""]
    rng.shuffle(strings)
    assert recipe._r_strings(_r_character_vector(strings)) == ["" if s is None else s for s in strings]
    with pytest.raises(ValueError, match="SEXP type 19"):
        recipe._r_strings(_r_character_vector(["a"]).replace(struct.pack(">ii", 16, 1), struct.pack(">ii", 19, 1)))
    with pytest.raises(ValueError, match="not an R XDR"):
        recipe._r_strings(b"A\n" + _r_character_vector(["a"])[2:])


def test_austen_novels_one_document_per_database_block(recipe, tmp_path):
    """Rdata.rdb: blocks of [u32 length][zlib stream], each a novel's lines; its first non-blank line names it."""
    rng = random.Random()
    titles = {"SENSE AND SENSIBILITY": "sense-and-sensibility", "  PRIDE & PREJUDICE ": "pride-prejudice",
              "Persuasion": "persuasion"}
    novels = [["", title, *(_line(rng) for _ in range(rng.randint(1, 300)))] for title in titles]
    blocks = [_r_character_vector(lines) for lines in novels]
    rdb = tmp_path / "root/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
    rdb.parent.mkdir(parents=True)
    rdb.write_bytes(b"".join(struct.pack(">I", len(b)) + zlib.compress(b, rng.randint(1, 9)) for b in blocks))
    (tmp_path / "out").mkdir()
    assert recipe.austen_novels(tmp_path / "root", tmp_path / "out") == 3
    files = sorted((tmp_path / "out").iterdir())
    assert [p.name for p in files] == [f"{i}-{slug}.txt" for i, slug in enumerate(titles.values())]
    assert [p.read_text() for p in files] == ["\n".join(lines) for lines in novels]


def test_split_books_keeps_chapters_and_drops_verse_numbers(recipe):
    """The `bible` binary's layout: a blank line, "Book N", a blank line, then "  V verse" lines."""
    rng = random.Random()
    books = {name: [[_line(rng) for _ in range(rng.randint(1, 20))] for _ in range(rng.randint(1, 4))]
             for name in ("Genesis", "1 Samuel", "Song of Solomon")}
    out = "".join(f"\n{name} {c + 1}\n\n" + "".join(f"  {v + 1} {verse}\n" for v, verse in enumerate(verses))
                  for name, chapters in books.items() for c, verses in enumerate(chapters))
    got = recipe.split_books(out)
    assert list(got) == list(books)
    for name, chapters in books.items():
        expected = [f"{name}\n", *chapters[0]]
        for c, verses in enumerate(chapters[1:], start=2):
            expected += [f"\nChapter {c}\n", *verses]
        assert got[name] == "\n".join(expected) + "\n"


@pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None,
                    reason="needs Debian's apt-get and dpkg-deb")
def test_real_packages(recipe, tmp_path):
    """The recipe's Austen and KJV sources from their Debian packages (4 MB): six novels, 66 books."""
    packages = ["r-cran-janeaustenr", "bible-kjv", "bible-kjv-text"]
    uris = subprocess.run(["apt-get", "download", "--print-uris", "-q", *packages], capture_output=True, text=True)
    if uris.returncode != 0:
        pytest.skip(f"apt cannot locate the packages (no package lists: apt-get update not run): {uris.stderr[-200:]}")
    host = urllib.parse.urlsplit(uris.stdout.split("'")[1])
    try:
        socket.create_connection((host.hostname, host.port or 80), timeout=10).close()
    except OSError as e:
        pytest.skip(f"Debian's mirror {host.hostname} is not reachable from here: {e}")
    root = recipe.download(packages, tmp_path / "work")
    (tmp_path / "austen").mkdir()
    (tmp_path / "bible").mkdir()
    assert recipe.austen_novels(root, tmp_path / "austen") == 6
    assert recipe.bible_books(root, tmp_path / "bible") == 66
    emma = (tmp_path / "austen" / "0-emma.txt").read_text()
    assert "Emma Woodhouse, handsome, clever, and rich" in emma and len(emma) > 800_000
    genesis = (tmp_path / "bible" / "00-Genesis.txt").read_text()
    assert genesis.startswith("Genesis\n") and "\nChapter 50\n" in genesis
    assert "In the beginning God created the heaven and the earth." in genesis
    assert (tmp_path / "bible" / "65-Revelation.txt").read_text().rstrip().endswith("Amen.")


@pytest.mark.skipif(shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None,
                    reason="needs Debian's apt-get and dpkg-deb")
def test_packages_apt_does_not_know_are_one_message(recipe, tmp_path, monkeypatch, capsys):
    """Without package lists (apt-get update never run) apt knows none of the packages: one line saying to pass
    --update, not apt-get download's traceback."""
    monkeypatch.setattr(recipe, "PACKAGES", ["foxlm-no-such-package"])
    assert recipe.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert "apt knows no package foxlm-no-such-package: run the recipe once with --update" in err
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_work_folders_the_recipe_did_not_make_are_never_deleted(recipe, tmp_path, capsys):
    """--work DIR: a user's DIR/root and DIR/text are refused, up front and where the recipe would replace them (it
    used to delete both unchecked); the folders it made itself are remade."""
    work = tmp_path / "work"
    for name in ("root", "text"):
        (work / name / "sub").mkdir(parents=True)
        (work / name / "NOTES.md").write_text("mine")
        (work / name / "sub" / "data.txt").write_text("also mine")
    before = {p: p.read_text() for p in work.rglob("*") if p.is_file()}
    assert recipe.main(["--out", str(tmp_path / "out"), "--work", str(work)]) == 2
    err = capsys.readouterr().err
    assert f"--work: {work / 'root'} and {work / 'text'} exist and were not made by this recipe" in err, err
    with pytest.raises(ValueError, match="was not made by this recipe"):
        recipe.download([], work)
    with pytest.raises(ValueError, match="was not made by this recipe"):
        recipe.collect(work / "root", work / "text")
    assert {p: p.read_text() for p in work.rglob("*") if p.is_file()} == before
    made = recipe.fresh_folder(tmp_path / "made")
    (made / "old.txt").write_text("an earlier run's")
    assert sorted(p.name for p in recipe.fresh_folder(made).iterdir()) == [recipe.MARKER]


def test_small_scale_recipe_needs_a_gpu_or_says_so(tmp_path):
    """On a machine without nvidia-smi the recipe stops before any work, naming ALLOW_CPU."""
    script = Path(__file__).parents[1] / "recipes/small_scale_claims.sh"
    bin_dir = tmp_path / "bin"  # PATH with bash and python3 but no nvidia-smi
    bin_dir.mkdir()
    for tool in ("python3", "date", "mkdir"):
        if (found := shutil.which(tool)) is not None:
            (bin_dir / tool).symlink_to(found)
    proc = subprocess.run([shutil.which("bash"), str(script)], cwd=tmp_path, env={"PATH": str(bin_dir)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no GPU here" in proc.stderr and "ALLOW_CPU=1" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_debian_out_is_checked_before_anything_is_downloaded(recipe, tmp_path, capsys):
    """An --out that holds a user's files, or lies under a file, is refused in one line before apt runs (it was
    prepare's traceback, after minutes of downloading and extracting); so is a --val-fraction prepare would refuse."""
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.md").write_text("a user's notes")
    (tmp_path / "file.txt").write_text("a file")
    for args, expected in ((["--out", str(tmp_path / "results")], "holds files and is not a foxlm dataset"),
                           (["--out", str(tmp_path / "file.txt" / "d")], "lies under the file"),
                           (["--out", str(tmp_path / "d"), "--val-fraction", "1.5"], "val_fraction (--val-fraction)")):
        assert recipe.main([*args, "--work", str(tmp_path / "work")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("debian_corpus.py: error: ") and expected in err, err
    assert not (tmp_path / "work").exists() and (tmp_path / "results" / "notes.md").read_text() == "a user's notes"


def test_mqar_recipe_errors_are_one_line(tmp_path, capsys):
    """Every error a user's input causes is one line: an --out under a file was a NotADirectoryError traceback."""
    spec = importlib.util.spec_from_file_location("mqar_recipe", Path(__file__).parents[1] / "recipes/mqar.py")
    mqar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mqar)
    (tmp_path / "file.txt").write_text("a file")
    assert mqar.main(["--out", str(tmp_path / "file.txt" / "d"), "--tokens", "200", "--tokenizer", "byte", "--vocab",
                      "0:48", "--pairs", "2", "--length", "16:32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mqar.py: error: out_dir (--out): ") and "under the file" in err
