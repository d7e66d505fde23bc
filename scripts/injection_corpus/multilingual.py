"""The multilingual benign tool-output set (issue #28): real translations and real files from two wheels, shaped
as what tools return.

Django's and Sphinx's wheels ship gettext catalogs (`locale/<lang>/LC_MESSAGES/*.po`): msgstr = real sentences
translated by people, in about 100 languages. They are read as zip files (nothing installed or imported).
Every example is benign. Kinds:

  message   2-6 msgstr of one catalog as a notification / e-mail / chat message / search snippet / plain text
  json      an API response whose string fields are msgstr of one catalog
  log       timestamped log lines (levels, request ids) whose messages are msgstr of one catalog
  csv       a table with a text column of msgstr of one catalog
  shell     `ls -l` of a wheel folder (real names, sizes, dates), `ps aux`, `git log` (subjects: English msgids)
  trace     a Python traceback through real modules and functions of Django, error text = an English msgid
  code      a chunk of a real Django .py / .js / .html file
  blob      base64 or hex (xxd) of real binary files of the wheel (.mo catalogs, images)

Split 60/20/20 by group with a seeded generator: a catalog (wheel + path: one app in one language) for the
kinds that read one, a wheel folder / source file / binary file otherwise, so a test example's sentences,
files and folders are never trained on. Every language has catalogs in every split.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
import zipfile
from pathlib import Path
from typing import Any

from injection_corpus.sources import Example, split_of

PO_WHEELS = {  # package: (wheel, licence)
    "django": ("django-5.2.19-py3-none-any.whl", "BSD-3-Clause"),
    "sphinx": ("sphinx-9.0.4-py3-none-any.whl", "BSD-2-Clause"),
}
SOURCE = "benign-multilingual"
ML_SEED = "issue-28:benign-multilingual"
PER_CATALOG = 2  # examples drawn from one catalog
_STR_RE = re.compile(r'^(msgid|msgstr)\s+"(.*)"\s*$|^"(.*)"\s*$')


def po_pairs(text: str) -> list[tuple[str, str]]:
    """(msgid, msgstr) of a .po file's singular, translated, non-fuzzy entries (header left out)."""
    out, cur, key, fuzzy = [], {"msgid": "", "msgstr": ""}, "", False
    for line in [*text.splitlines(), ""]:
        m = _STR_RE.match(line)
        if m and m.group(1):
            key, cur[m.group(1)] = m.group(1), _unescape(m.group(2))
        elif m and key:
            cur[key] += _unescape(m.group(3))
        elif line.startswith("#,") and "fuzzy" in line:
            fuzzy = True
        elif not line.strip():
            if cur["msgid"] and cur["msgstr"] and not fuzzy:
                out.append((cur["msgid"], cur["msgstr"]))
            cur, key, fuzzy = {"msgid": "", "msgstr": ""}, "", False
        elif line.startswith(("msgid_plural", "msgstr[", "msgctxt")):
            key = ""
    return out


def _unescape(s: str) -> str:
    return s.replace('\\"', '"').replace("\\n", "\n").replace("\\t", "\t").replace("\\\\", "\\")


def _ts(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"


def _message(rng: random.Random, lang: str, s: list[str]) -> str:
    form = rng.randrange(5)
    body = " ".join(s) if rng.random() < 0.5 else "\n".join(s)
    if form == 0:
        return body
    if form == 1:
        return f"From: noreply@example.{lang.split('_')[0].lower()}\nSubject: {s[0][:80]}\nDate: {_ts(rng)}\n\n{body}\n"
    if form == 2:
        return "\n".join(f"[{_ts(rng)}] user{rng.randint(1, 99)}: {x}" for x in s)
    if form == 3:
        return "\n\n".join(
            f"{i + 1}. {x[:60]}\n   https://docs.example.org/{lang}/{i}\n   {x}" for i, x in enumerate(s)
        )
    return f"Notification ({lang}): {body}"


def _json(rng: random.Random, lang: str, s: list[str]) -> str:
    items = [{"id": rng.randint(1, 99999), "label": x, "updated": _ts(rng)} for x in s[1:]]
    doc = {
        "status": "ok",
        "locale": lang,
        "title": s[0],
        "items": items,
        "page": {"next": None, "size": len(items)},
    }
    return json.dumps(doc, ensure_ascii=rng.random() < 0.2, indent=rng.choice([None, 2]))


def _log(rng: random.Random, lang: str, s: list[str]) -> str:
    lv = ["INFO", "INFO", "WARNING", "DEBUG", "ERROR"]
    return "\n".join(
        f"{_ts(rng)} {rng.choice(lv):7s} [req-{rng.getrandbits(32):08x}] app.{lang}: {x}" for x in s
    )


def _csv(rng: random.Random, lang: str, s: list[str]) -> str:
    rows = ["id,locale,text,count"] + [
        f'{i},{lang},"{x.replace(chr(34), chr(34) * 2)}",{rng.randint(0, 500)}' for i, x in enumerate(s)
    ]
    return "\n".join(rows)


FORMS = {"message": _message, "json": _json, "log": _log, "csv": _csv}


def catalog_examples(name: str, pkg: str, text: str, rng: random.Random) -> list[tuple[str, str, str]]:
    """(kind, group, text) of up to PER_CATALOG examples of one catalog."""
    lang = name.split("/locale/")[1].split("/")[0]
    strs = [v.strip() for _, v in po_pairs(text) if len(v.strip()) >= 3]
    if len(strs) < 4:
        return []
    out = []
    for _ in range(PER_CATALOG):
        kind = rng.choice(list(FORMS))
        s = rng.sample(strs, min(len(strs), rng.randint(2, 6)))
        out.append((kind, f"{pkg}:{name}", FORMS[kind](rng, lang, s)))
    return out


def shell_examples(
    z: zipfile.ZipFile, pkg: str, english: list[str], rng: random.Random
) -> list[tuple[str, str, str]]:
    """`ls -l` of real folders, `ps aux`, `git log`, tracebacks through real functions."""
    out = []
    infos = z.infolist()
    folders = sorted({i.filename.rsplit("/", 1)[0] for i in infos if "/" in i.filename})
    for d in rng.sample(folders, min(60, len(folders))):
        files = [i for i in infos if i.filename.rsplit("/", 1)[0] == d][:25]
        lines = [f"total {sum(i.file_size for i in files) // 1024}"] + [
            f"-rw-r--r-- 1 app app {i.file_size:>8} {'Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec'.split()[i.date_time[1] - 1]} "
            f"{i.date_time[2]:>2} {i.date_time[3]:02d}:{i.date_time[4]:02d} {i.filename.rsplit('/', 1)[1]}"
            for i in files
        ]
        out.append(("shell", f"{pkg}:ls:{d}", "$ ls -l " + d + "\n" + "\n".join(lines)))
    funcs: list[tuple[str, str, int]] = []
    for i in infos:
        if i.filename.endswith(".py") and len(funcs) < 4000:
            src = z.read(i).decode("utf-8", "replace").splitlines()
            funcs += [
                (i.filename, ln.split("def ", 1)[1].split("(")[0], k + 1)
                for k, ln in enumerate(src)
                if ln.lstrip().startswith("def ")
            ]
    errors = ["ValueError", "KeyError", "TypeError", "RuntimeError", "PermissionError", "ValidationError"]
    for _ in range(60):
        frames = rng.sample(funcs, rng.randint(2, 7))
        body = "".join(
            f'  File "/srv/app/.venv/lib/python3.12/site-packages/{f}", line {n}, in {fn}\n    {fn}(request, *args, **kwargs)\n'
            for f, fn, n in frames
        )
        out.append(
            (
                "trace",
                f"{pkg}:trace:{frames[-1][0]}",
                f"Traceback (most recent call last):\n{body}{rng.choice(errors)}: {rng.choice(english)}",
            )
        )
    cmds = [
        "/usr/sbin/nginx -g daemon off;",
        "postgres: writer process",
        "python -m gunicorn app.wsgi -w 4",
        "redis-server *:6379",
        "/usr/bin/containerd",
        "node /srv/web/server.js",
        "celery -A proj worker -l info",
        "sshd: /usr/sbin/sshd -D",
        "[kworker/0:1-events]",
    ]
    for k in range(40):
        rows = ["USER         PID %CPU %MEM    VSZ   RSS TTY      STAT START   TIME COMMAND"] + [
            f"{rng.choice(['root', 'app', 'postgres', 'www-data']):10s} {rng.randint(1, 65000):6d} {rng.random() * 20:4.1f} {rng.random() * 8:4.1f} "
            f"{rng.randint(1000, 900000):6d} {rng.randint(500, 300000):5d} ?        Ss   {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}   0:{rng.randint(0, 59):02d} {rng.choice(cmds)}"
            for _ in range(rng.randint(4, 14))
        ]
        out.append(("shell", f"{pkg}:ps:{k}", "$ ps aux\n" + "\n".join(rows)))
    names = [
        "Mariusz Felisiak",
        "Sarah Boyce",
        "Natalia Bidart",
        "Adam Johnson",
        "Claude Paroz",
        "Jacob Walls",
        "Tim Graham",
    ]
    for k in range(60):
        log = []
        for _ in range(rng.randint(2, 6)):
            sha = hashlib.sha1(f"{k}:{rng.random()}".encode()).hexdigest()
            who = rng.choice(names)
            log.append(
                f"commit {sha}\nAuthor: {who} <{who.split()[0].lower()}@example.com>\nDate:   {_ts(rng)}\n\n    Fixed #{rng.randint(10000, 36000)} -- {rng.choice(english)}\n"
            )
        out.append(("shell", f"{pkg}:git:{k}", "$ git log\n" + "\n".join(log)))
    return out


def file_examples(z: zipfile.ZipFile, pkg: str, rng: random.Random) -> list[tuple[str, str, str]]:
    """Chunks of real code files, and base64 / hex dumps of real binary files."""
    out = []
    code = [i for i in z.infolist() if i.filename.endswith((".py", ".js", ".html")) and i.file_size > 400]
    for i in rng.sample(code, min(150, len(code))):
        text = z.read(i).decode("utf-8", "replace")
        a = rng.randrange(max(1, len(text) - 1200))
        out.append(("code", f"{pkg}:file:{i.filename}", text[a : a + rng.randint(300, 1500)]))
    blobs = [
        i
        for i in z.infolist()
        if i.filename.endswith((".mo", ".png", ".gif", ".woff", ".woff2", ".ico")) and i.file_size > 200
    ]
    for i in rng.sample(blobs, min(150, len(blobs))):
        raw = z.read(i)
        a = rng.randrange(max(1, len(raw) - 600))
        piece = raw[a : a + rng.randint(64, 600)]
        if rng.random() < 0.5:
            b64 = base64.b64encode(piece).decode()
            text = rng.choice(
                [
                    b64,
                    json.dumps({"name": i.filename.rsplit("/", 1)[1], "encoding": "base64", "content": b64}),
                ]
            )
        else:
            text = "\n".join(
                f"{k:08x}: " + " ".join(piece[k + j : k + j + 2].hex() for j in range(0, 16, 2))
                for k in range(0, len(piece), 16)
            )
        out.append(("blob", f"{pkg}:blob:{i.filename}", text))
    return out


def load_multilingual(wheel_dir: Path) -> tuple[list[Example], list[dict[str, Any]]]:
    """Every example of the set with its split, and each wheel's provenance (package, version, licence, sha256)."""
    rng = random.Random(ML_SEED)
    rows: list[tuple[str, str, str]] = []
    provenance = []
    for pkg, (fname, licence) in PO_WHEELS.items():
        path = wheel_dir / fname
        provenance.append(
            {
                "package": pkg,
                "version": fname.split("-")[1],
                "licence": licence,
                "wheel": fname,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        )
        z = zipfile.ZipFile(path)
        english: list[str] = []
        for name in sorted(n for n in z.namelist() if n.endswith(".po")):
            text = z.read(name).decode("utf-8", "replace")
            if "/locale/de/" in name:
                english += [k for k, _ in po_pairs(text) if len(k) >= 12]
            rows += catalog_examples(name, pkg, text, rng)
        rows += shell_examples(z, pkg, english, rng)
        # NOTE: sphinx's code is already a benign source of the labelled corpus (pypi-files)
        if pkg == "django":
            rows += file_examples(z, pkg, rng)
    splits = split_of([g for _, g, _ in rows], rng)
    data = [Example(t, 0, SOURCE, g, splits[g], k) for k, g, t in rows]
    return data, provenance
