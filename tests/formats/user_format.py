"""A user's own tool-call format, loaded as ``module:Class`` (tests/formats/test_registry.py):
calls written as ``CALL name {json}`` lines."""

from __future__ import annotations

import json

from specserve.formats.tools.base import ToolCallFormat, ToolParser, lark_json, lark_string


class LineParser(ToolParser):
    def _run(self, final: bool) -> None:
        while True:
            end = self.buf.find("\n", self.pos)
            if end < 0 and not final:
                return
            line = self.buf[self.pos : end if end >= 0 else len(self.buf)]
            self.pos = end + 1 if end >= 0 else len(self.buf)
            if line.startswith("CALL "):
                name, _, args = line[5:].partition(" ")
                if name in self.tools:
                    index = self._call(name)
                    self._args(index, json.dumps(json.loads(args or "{}")))
                    continue
            self._content(line + ("\n" if end >= 0 else ""))
            if end < 0:
                self._content_end()
                return


class LineFormat(ToolCallFormat):
    name = "lines"

    def parser(self, tools, make_id=None):
        return LineParser(tools) if make_id is None else LineParser(tools, make_id)

    def grammar(self, tools, parallel):
        body = " | ".join(f"{lark_string('CALL ' + t.name + ' ')} {lark_json(t.schema())}" for t in tools)
        return f"start: ({body})"
