"""A sweep's rows in a file (`fsdp-sim sweep -o FILE`): written as they finish, read back by `--resume`.

The format follows the file's name: `.json` an array, one row per line; `.jsonl` JSON lines, one row per
line and nothing else; any other name CSV, a header of the swept keys and the figure columns, then a row
per line (a figure a row lacks, as one whose point failed does, is an empty cell). Bytes are integers in
every format.

While a sweep runs, each finished chunk's rows are appended and flushed, so Ctrl-C, a killed process or a
dead worker leaves every finished row in the file (a JSON array then lacks its closing `]`). When the
sweep completes, the file is rewritten in the sweep's order (a temporary file renamed over it), so that a
finished file is the same however the sweep ran: on local processes or Dask, whole or resumed. A path
that names no regular file, even through a link (a terminal, a pipe, `/dev/null`), is written as the rows
finish and only that.

`resume` reads the file back and matches each row to its point by the swept values as the format writes
them. A header that is not the sweep's, or a row that is no point of it, is refused (a different grid or
command); a last line cut short by a kill is dropped, and its point runs again.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fsdp_sim.errors import ScenarioError, show


def kind(path: str) -> str:
    """`json`, `jsonl` or `csv`, by the file's name."""
    name = path.lower()
    return "jsonl" if name.endswith(".jsonl") else "json" if name.endswith(".json") else "csv"


def _cell(value: Any) -> str:
    """A value as its CSV cell: what `csv.writer` writes, with None as an empty cell."""
    return "" if value is None else value if isinstance(value, str) else str(value)


def _json_id(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _typed(text: str) -> Any:
    """A CSV figure back as the value it was written from (`str` of a bool, an int or a float reads back
    equal; anything else stays text)."""
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


class RowFile:
    """The rows of one sweep in `path`: `start` (fresh or resumed), `append` per finished chunk, `finish`."""

    def __init__(self, path: str, fields: list[str], swept: list[str]):
        self.path, self.fields, self.swept, self.kind = path, fields, swept, kind(path)
        self.count = 0  # rows in the file
        self._fh = None
        self._texts: dict[int, str] = {}  # each row in the file as written, by its point's index: `finish` reuses it

    # -- identity -------------------------------------------------------------------------------------
    def point_id(self, values: dict) -> tuple:
        """A point by its swept values, as this format writes them (so a row read back has the same id)."""
        if self.kind == "csv":
            return tuple(_cell(values.get(k)) for k in self.swept)
        return tuple(_json_id(values.get(k)) for k in self.swept)

    # -- writing --------------------------------------------------------------------------------------
    def _target(self) -> Path | None:
        """The regular file the path names, through any symbolic link (`/dev/stdout` redirected to a file
        names that file), which `finish` may replace; None for a terminal, a pipe or a device, which are
        written as the rows finish and only that (replacing `/dev/stdout` itself would be a disaster)."""
        real = Path(os.path.realpath(self.path))
        try:
            return real if real.is_file() else None
        except OSError:
            return None

    def _lines(self, at: Iterable[int], rows: Iterable[dict]) -> str:
        """The rows' text (a line each), remembered by their points' indices `at` for `finish`."""
        texts = []
        if self.kind == "csv":
            out, ends = io.StringIO(), [0]
            writer = csv.writer(out)
            for row in rows:
                writer.writerow([_cell(row.get(k)) for k in self.fields])
                ends.append(out.tell())
            whole = out.getvalue()
            texts = [whole[a:b] for a, b in zip(ends, ends[1:])]
        else:
            try:
                texts = [json.dumps(row, allow_nan=False) + "\n" for row in rows]
            except (ValueError, TypeError) as exc:
                raise ScenarioError(f"-o {self.path}: a row cannot be written as JSON ({exc})") from None
        self._texts.update(zip(at, texts))
        return "".join(texts)

    def _text(self, lines: str, closed: bool) -> str:
        """The whole file: header (CSV) or `[` (JSON), the rows' `lines`, and for a finished JSON array its `]`."""
        if self.kind == "csv":
            header = io.StringIO()
            csv.writer(header).writerow(self.fields)
            return header.getvalue() + lines
        if self.kind == "jsonl":
            return lines
        body = lines.rstrip("\n").replace("\n", ",\n")
        return "[\n" + body + ("\n]\n" if closed else "")

    def _error(self, exc: OSError) -> ScenarioError:
        return ScenarioError(f"-o {self.path}: cannot write: {exc.strerror or exc}")

    def _replace(self, target: Path, text: str) -> None:
        """The regular file `target`'s content set to `text` at once: a kill meanwhile leaves the old
        content or the new (a temporary file beside it, renamed over it)."""
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8", newline="") as fh:
                fh.write(text)
            os.chmod(tmp, target.stat().st_mode & 0o7777)
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self._error(exc) from None

    def start(self, kept: dict[int, dict] | None = None, target: Path | None = None) -> None:
        """Open the file for the sweep's rows: fresh (a header), or holding the `kept` rows of a resume, by
        their points' indices (the regular file `target` rewritten without a torn tail, and a JSON array
        without its `]`)."""
        kept = kept or {}
        try:
            if kept:
                self._replace(target, self._text(self._lines(kept, kept.values()), closed=False))
                self._fh = open(self.path, "a", encoding="utf-8", newline="")
            else:
                self._fh = open(self.path, "w", encoding="utf-8", newline="")
                self._fh.write(self._text("", closed=False))
                self._fh.flush()
        except OSError as exc:
            raise self._error(exc) from None
        self.count = len(kept)

    def append(self, at: list[int], rows: list[dict]) -> None:
        """A finished chunk's rows (of the points `at`), flushed to the operating system (a killed process
        keeps them)."""
        if not rows:
            return
        text = self._lines(at, rows)
        if self.kind == "json":
            text = ("" if self.count == 0 else ",\n") + text.rstrip("\n").replace("\n", ",\n")
        try:
            self._fh.write(text)
            self._fh.flush()
        except OSError as exc:
            raise self._error(exc) from None
        self.count += len(rows)

    def close(self) -> None:
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None

    def finish(self, rows: list[dict]) -> None:
        """The completed sweep: the file rewritten as `rows` (the sweep's order; each row's text as written,
        not formatted again), or closed as written."""
        self.close()
        target = self._target()
        if target is not None:
            unwritten = [i for i in range(len(rows)) if i not in self._texts]
            self._lines(unwritten, [rows[i] for i in unwritten])
            self._replace(target, self._text("".join(self._texts[i] for i in range(len(rows))), closed=True))
        elif self.kind == "json":
            try:
                with open(self.path, "a", encoding="utf-8") as fh:
                    fh.write("\n]\n")
            except OSError as exc:
                raise self._error(exc) from None

    # -- reading back ---------------------------------------------------------------------------------
    def _refuse(self, what: str) -> ScenarioError:
        return ScenarioError(f"--resume: {self.path}: {what}")

    def _records(self, text: str) -> list[dict]:
        """The file's complete rows, in file order, as read (CSV cells are text)."""
        if self.kind == "csv":
            torn = not text.endswith("\n")  # the last line was cut short: its row was not finished
            try:
                records = list(csv.reader(io.StringIO(text)))
            except csv.Error as exc:
                raise self._refuse(f"not CSV ({exc})") from None
            if not records:
                return []
            if records[0] != self.fields:
                raise self._refuse(f"its columns are not this sweep's: {show(records[0], 120)}, expected "
                                   f"{show(self.fields, 120)} (a different grid or --set?)")
            body = records[1:]
            if body and (torn or len(body[-1]) != len(self.fields)):
                body.pop()
            for n, cells in enumerate(body, start=2):
                if len(cells) != len(self.fields):
                    raise self._refuse(f"row {n} has {len(cells)} cells, expected {len(self.fields)}")
            return [dict(zip(self.fields, cells)) for cells in body]
        if self.kind == "json":
            try:
                whole = json.loads(text)
            except ValueError:
                whole = None
            if isinstance(whole, list):  # a finished array, however it is laid out
                return self._objects([json.dumps(r) for r in whole])
            lines = text.split("\n")
            if lines[0].strip() != "[":
                raise self._refuse("not a JSON array of rows (it does not start with '[')")
            return self._objects([line.removesuffix(",") for line in lines[1:]])
        return self._objects(text.split("\n"))

    def _objects(self, lines: list[str]) -> list[dict]:
        """One JSON object per line; the last line may be cut short (a cut object does not parse: its
        closing brace comes last) or empty."""
        out = []
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                if not any(rest.strip() for rest in lines[n:]):  # the last line
                    break
                raise self._refuse(f"line {n} is not a JSON row") from None
            if not isinstance(row, dict):
                raise self._refuse(f"line {n} is not a JSON object")
            out.append(row)
        return out

    def resume(self, chosen: list[dict]) -> dict[int, dict]:
        """The rows already in the file, by the index of their point in `chosen` (each point's swept values).
        The file is left holding exactly them, in file order, ready for `append`."""
        if not os.path.lexists(self.path):
            self.start()
            return {}
        target = self._target()
        if target is None:
            raise self._refuse("not a regular file")
        try:
            with open(target, encoding="utf-8", newline="") as fh:  # CSV's \r\n as written
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise self._refuse(f"cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
        index: dict[tuple, int] = {}
        for i, values in enumerate(chosen):
            other = index.setdefault(self.point_id(values), i)
            if other != i:
                raise self._refuse(f"two points read back alike, {show(chosen[other])} and {show(values)}; "
                                   "write .jsonl to resume this sweep")
        found: dict[int, dict] = {}  # in file order
        for n, record in enumerate(self._records(text), start=1):
            missing = [k for k in self.swept if k not in record]
            if missing:
                raise self._refuse(f"row {n} has no {missing[0]!r} (a different grid or --set?)")
            i = index.get(self.point_id(record))
            if i is None:
                raise self._refuse(f"row {n} ({', '.join(f'{k}={record[k]}' for k in self.swept)}) is not a point "
                                   "of this sweep (a different grid or --set?)")
            if i in found:
                continue  # written twice: the first stands
            found[i] = self._row(record, chosen[i])
        self.start(found, target)
        return found

    def _row(self, record: dict, values: dict) -> dict:
        """A row read back as the sweep made it: the point's own swept values, the figures typed."""
        row = dict.fromkeys(k for k in self.fields if k in record or k in self.swept)
        row.update({k: values.get(k) for k in self.swept})
        if self.kind != "csv":
            row.update({k: v for k, v in record.items() if k not in self.swept})
            return row
        failed = record.get("error", "") != ""
        for k, text in record.items():
            if k in self.swept:
                continue
            if k == "error":
                row[k] = text
            elif text == "" and failed:
                del row[k]  # a failed point's row has no figures
            else:
                row[k] = None if text == "" else _typed(text)
        return row
