"""ComfyUI graphs read as ComfyUI's executor sees them: one table of nodes whose inputs are links or literal values.

Two formats come in:

* the **UI format** the editor saves (`nodes`, `links`, and `definitions.subgraphs`): subgraphs are flattened the way
  ComfyUI queues them (an inner node of instance `140` is node `140:131`; an input the instance takes from outside,
  or a widget it promotes, is wired through), `Reroute`s and the legacy `PrimitiveNode` are resolved, notes
  dropped, muted nodes (mode 2) removed and bypassed ones (mode 4) passed through by type, as the editor does when it
  queues a graph;
* the **API format** (`{id: {"class_type", "inputs"}}`, also inside a `POST /prompt` body's `"prompt"`).

Every literal value keeps where it is written (`Literal.origin`, `NODE.WIDGET`): refusals name it and `set_widget`
changes it there (for a widget a subgraph instance promotes, on the instance: `140.vae_name`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stagekit.errors import InvalidArgument

MAX_GRAPH_BYTES = 4 << 20     # a graph with its notes is ~100 KB; a template with huge notes stays far below
MAX_NODES = 5000
MAX_SUBGRAPH_DEPTH = 16
MODE_MUTED, MODE_BYPASSED = 2, 4          # LiteGraph modes: "never" (skip) and bypass (inputs passed through)
SUBGRAPH_INPUT, SUBGRAPH_OUTPUT = -10, -20  # a subgraph's own input / output node in its links
FRONTEND_NOTES = frozenset({"Note", "MarkdownNote"})  # text on the canvas, never sent to the executor


class GraphError(InvalidArgument):
    """A graph that cannot be read (not JSON, neither format, a broken link); the message says where."""


@dataclass(frozen=True)
class Link:
    """An input fed by output `slot` of node `node`."""

    node: str
    slot: int


@dataclass(frozen=True)
class Literal:
    """An input's own value, and where it is written: `NODE.WIDGET` (what `--set NODE.WIDGET=VALUE` changes)."""

    value: Any
    origin: str


@dataclass
class Node:
    id: str
    type: str
    inputs: dict[str, Link | Literal] = field(default_factory=dict)
    title: str = ""
    # UI format only: unnamed widget values (the file does not name them), named later by the node's table entry
    positional: list | None = None

    def label(self) -> str:
        """How messages name the node: `ResolutionSelector node 115`."""
        return f"{self.type} node {self.id}"


# A node type's widget names, in the order an unnamed `widgets_values` list holds them (one tuple per layout the
# editor writes; the one of the list's length is taken). Given by the caller: the table of nodes the product runs.
WidgetLayouts = Callable[[str], tuple[tuple[str, ...], ...]]


@dataclass
class Graph:
    nodes: dict[str, Node]
    format: str                      # "ui" | "api"

    def node(self, node_id: str) -> Node:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise GraphError(f"the graph has no node {node_id!r}") from None

    def api(self) -> dict:
        """The graph in ComfyUI's API format, as the editor queues it: {id: {"class_type", "inputs", "_meta"}}."""
        return {nid: {"class_type": n.type, "_meta": {"title": n.title or n.type},
                      "inputs": {k: [v.node, v.slot] if isinstance(v, Link) else v.value for k, v in n.inputs.items()}}
                for nid, n in self.nodes.items()}

    def set_widget(self, key: str, text: str) -> None:
        """`--set NODE.WIDGET=VALUE`: the literal written at `NODE.WIDGET` takes `text` (read as the type of the value
        there: a number, true/false, or text as given). A widget fed by a link, one a subgraph instance promotes
        (named on the instance), or a name the node does not have is refused naming what to set instead."""
        node_id, dot, widget = key.rpartition(".")
        if not dot or not node_id or not widget:
            raise GraphError(f"--set {key}=...: name a node and one of its widgets as NODE.WIDGET "
                             "(e.g. 115.megapixels)")
        found = [(n, name) for n in self.nodes.values() for name, v in n.inputs.items()
                 if isinstance(v, Literal) and v.origin == key]
        if not found:
            node = self.nodes.get(node_id)
            if node is None:
                raise GraphError(f"--set {key}: the graph has no node {node_id!r}")
            if widget in node.inputs:
                v = node.inputs[widget]
                if isinstance(v, Link):
                    raise GraphError(f"--set {key}: {node.label()}'s {widget} comes from node {v.node}'s output "
                                     f"{v.slot}; set the value there")
                raise GraphError(f"--set {key}: {node.label()}'s {widget} is written at {v.origin}; "
                                 f"--set {v.origin}=...")
            have = sorted(k for k, v in node.inputs.items() if isinstance(v, Literal))
            raise GraphError(f"--set {key}: {node.label()} has no widget {widget!r}"
                             + (f"; its widgets are {', '.join(have)}" if have else ""))
        old = found[0][0].inputs[found[0][1]].value
        value = _typed(text, old, key)
        for n, name in found:
            n.inputs[name] = Literal(value, key)


def _typed(text: str, like: Any, key: str) -> Any:
    """`text` read as the type of `like`, the value it replaces."""
    try:
        if isinstance(like, bool):
            low = text.strip().lower()
            if low not in ("true", "false", "1", "0"):
                raise ValueError
            return low in ("true", "1")
        if isinstance(like, (int, float)):  # JSON writes 5.0 as 5: a number widget takes either
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    except ValueError:
        kind = "true or false" if isinstance(like, bool) else "a number"
        raise GraphError(f"--set {key}={text}: the value there is {json.dumps(like)}; give {kind}") from None
    return text


def parse_graph(data: bytes | str | Mapping, layouts: WidgetLayouts) -> Graph:
    """A graph in either format (JSON text or its parsed object); a `POST /prompt` body (`{"prompt": {...}}`) too."""
    if isinstance(data, (bytes, str)):
        if len(data) > MAX_GRAPH_BYTES:
            raise GraphError(f"the graph is {len(data)} bytes; at most {MAX_GRAPH_BYTES} are read")
        try:
            data = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise GraphError(f"the graph is not valid JSON ({str(e)[:120]})") from None
    if not isinstance(data, Mapping):
        raise GraphError("a graph is a JSON object: ComfyUI's saved workflow (with `nodes` and `links`) or its API "
                         "format ({id: {\"class_type\", \"inputs\"}})")
    if isinstance(data.get("prompt"), Mapping) and "nodes" not in data:
        data = data["prompt"]
    if isinstance(data.get("nodes"), list):
        return _UIGraph(data, layouts).flatten()
    if data and all(isinstance(v, Mapping) and "class_type" in v for v in data.values()):
        return _api_graph(data)
    raise GraphError("this JSON is neither a ComfyUI workflow (`nodes`, `links`) nor an API-format graph "
                     "({id: {\"class_type\", \"inputs\"}})")


def _api_graph(data: Mapping) -> Graph:
    if len(data) > MAX_NODES:
        raise GraphError(f"the graph has {len(data)} nodes; at most {MAX_NODES} are read")
    nodes = {}
    for nid, spec in data.items():
        nid = str(nid)
        if not isinstance(spec.get("class_type"), str) or not isinstance(spec.get("inputs", {}), Mapping):
            raise GraphError(f"node {nid}: an API-format node is {{\"class_type\": TYPE, \"inputs\": {{...}}}}")
        inputs: dict[str, Link | Literal] = {}
        for name, v in spec.get("inputs", {}).items():
            if (isinstance(v, list) and len(v) == 2 and isinstance(v[1], int) and not isinstance(v[1], bool)
                    and str(v[0]) in data):
                inputs[name] = Link(str(v[0]), v[1])
            else:
                inputs[name] = Literal(v, f"{nid}.{name}")
        meta = spec.get("_meta") if isinstance(spec.get("_meta"), Mapping) else {}
        nodes[nid] = Node(nid, spec["class_type"], inputs, str(meta.get("title") or ""))
    return Graph(nodes, "api")


class _UIGraph:
    """The editor's format, flattened (module docstring)."""

    def __init__(self, data: Mapping, layouts: WidgetLayouts):
        self.layouts = layouts
        self.subgraphs = {sg.get("id"): sg for sg in (data.get("definitions") or {}).get("subgraphs") or []
                          if isinstance(sg, Mapping)}
        self.top = data
        self.nodes: dict[str, Node] = {}
        self.aliases: dict[tuple[str, int], Link | Literal | None] = {}  # an output that stands for another value
        self.muted: set[str] = set()   # muted nodes: a link from one reads as unconnected
        self.bypassed: dict[str, tuple[dict, dict[str, Link | Literal]]] = {}  # id -> (raw node, its inputs)

    def flatten(self) -> Graph:
        self._add_graph(self.top, prefix="", outer=None, depth=0)
        if len(self.nodes) > MAX_NODES:
            raise GraphError(f"the graph has {len(self.nodes)} nodes; at most {MAX_NODES} are read")
        for node in self.nodes.values():
            for name, v in list(node.inputs.items()):
                resolved = self._resolve(v, 0) if isinstance(v, Link) else v
                if resolved is None:
                    del node.inputs[name]
                else:
                    node.inputs[name] = resolved
        return Graph(self.nodes, "ui")

    # ---- one graph level (the top, or a subgraph instance's definition) ----------------------------------------
    def _add_graph(self, g: Mapping, prefix: str, outer: tuple[str, Mapping, dict] | None, depth: int) -> None:
        """Add `g`'s nodes under `prefix` ("" or "140:"). `outer`: (the instance's id, its subgraph definition, the
        instance's inputs by the subgraph input's name) when `g` is a subgraph."""
        if depth > MAX_SUBGRAPH_DEPTH:
            raise GraphError(f"subgraphs nest deeper than {MAX_SUBGRAPH_DEPTH} levels")
        links = _link_table(g.get("links") or [])
        for raw in g.get("nodes") or []:
            if not isinstance(raw, Mapping) or "id" not in raw or not isinstance(raw.get("type"), str):
                raise GraphError(f"a node of the graph{' in subgraph ' + prefix[:-1] if prefix else ''} has no id "
                                 "or type")
            nid = f"{prefix}{raw['id']}"
            if raw["type"] in FRONTEND_NOTES:
                continue
            inputs = self._inputs(raw, links, prefix, outer)
            mode = raw.get("mode", 0)
            if mode == MODE_MUTED:
                self.muted.add(nid)
                for slot in range(len(raw.get("outputs") or [])):
                    self.aliases[(nid, slot)] = None
                continue
            if mode == MODE_BYPASSED:
                self.bypassed[nid] = (raw, inputs)
                continue
            if raw["type"] == "Reroute":
                self.aliases[(nid, 0)] = next(iter(inputs.values()), None)
                continue
            if raw["type"] == "PrimitiveNode":  # the editor's legacy primitive: its value is the widget it feeds
                values = raw.get("widgets_values") or [None]
                self.aliases[(nid, 0)] = Literal(values[0], f"{nid}.value")
                continue
            sg = self.subgraphs.get(raw["type"])
            if sg is not None:
                self._add_instance(nid, raw, sg, inputs, depth)
                continue
            node = Node(nid, raw["type"], inputs, str(raw.get("title") or ""))
            self._widgets(node, raw)
            self.nodes[nid] = node

    def _inputs(self, raw: Mapping, links: dict, prefix: str, outer) -> dict[str, Link | Literal]:
        """A node's linked inputs: links to nodes of this level, or through a subgraph input to what feeds it."""
        out: dict[str, Link | Literal] = {}
        for inp in raw.get("inputs") or []:
            if not isinstance(inp, Mapping) or inp.get("link") is None:
                continue
            link = links.get(inp["link"])
            if link is None:
                raise GraphError(f"node {prefix}{raw['id']}: input {inp.get('name')!r} names link {inp['link']}, "
                                 "which the graph does not have")
            origin, slot = link[:2]
            if origin == SUBGRAPH_INPUT:
                if outer is None:
                    raise GraphError(f"node {raw['id']}: a link from a subgraph input outside any subgraph")
                source = self._subgraph_input(outer, slot)
                if source is not None:
                    out[inp["name"]] = source
            else:
                out[inp["name"]] = Link(f"{prefix}{origin}", slot)
        return out

    @staticmethod
    def _subgraph_input(outer, slot: int) -> Link | Literal | None:
        _, sg, instance_inputs = outer
        declared = sg.get("inputs") or []
        if not 0 <= slot < len(declared):
            raise GraphError(f"subgraph {sg.get('name') or sg.get('id')}: a link from its input {slot}, which it does "
                             "not declare")
        return instance_inputs.get(declared[slot].get("name"))

    def _add_instance(self, nid: str, raw: Mapping, sg: Mapping, inputs: dict, depth: int) -> None:
        """A subgraph instance: its inner nodes under `nid:`, fed by the instance's links and promoted widgets."""
        declared = [i.get("name") for i in sg.get("inputs") or []]
        widgets = self._instance_widgets(nid, raw, sg)
        feeds: dict[str, Link | Literal] = {}
        for name in declared:
            if name in inputs:
                feeds[name] = inputs[name]
            elif name in widgets:
                feeds[name] = Literal(widgets[name], f"{nid}.{name}")
        self._add_graph(sg, f"{nid}:", (nid, sg, feeds), depth + 1)
        outputs = {}
        for origin, slot, target, target_slot in _link_table(sg.get("links") or []).values():
            if target == SUBGRAPH_OUTPUT:
                outputs[target_slot] = (self._subgraph_input((nid, sg, feeds), slot) if origin == SUBGRAPH_INPUT
                                        else Link(f"{nid}:{origin}", slot))
        for k in range(len(sg.get("outputs") or [])):
            self.aliases[(nid, k)] = outputs.get(k)

    @staticmethod
    def _instance_widgets(nid: str, raw: Mapping, sg: Mapping) -> dict[str, Any]:
        """The values an instance's promoted widgets hold: named in the file, or in the order of the subgraph inputs
        that feed an inner widget (GraphError when their count differs: taking the inner nodes' own values instead
        would render something else than the instance shows)."""
        named = raw.get("widgets_values_named")
        if isinstance(named, Mapping):
            return dict(named)
        values = raw.get("widgets_values")
        if not isinstance(values, list):
            return {}
        links = _link_table(sg.get("links") or [])
        widget_inputs = set()
        for n in sg.get("nodes") or []:
            for inp in n.get("inputs") or []:
                if isinstance(inp, Mapping) and "widget" in inp and inp.get("link") in links:
                    origin, slot = links[inp["link"]][:2]
                    if origin == SUBGRAPH_INPUT:
                        widget_inputs.add(slot)
        names = [i.get("name") for k, i in enumerate(sg.get("inputs") or []) if k in widget_inputs]
        if len(names) != len(values):
            raise GraphError(f"subgraph instance {nid} ({sg.get('name') or sg.get('id')}) holds {len(values)} widget "
                             f"values for {len(names)} promoted widgets ({', '.join(map(str, names))}): save the graph "
                             "again with a current ComfyUI")
        return dict(zip(names, values))

    def _widgets(self, node: Node, raw: Mapping) -> None:
        """The node's own widget values (an input already linked keeps its link, as in ComfyUI)."""
        named = raw.get("widgets_values_named")
        values = raw.get("widgets_values")
        if not isinstance(named, Mapping) and isinstance(values, list):
            layout = next((ly for ly in self.layouts(node.type) if len(ly) == len(values)), None)
            if layout is None:
                node.positional = list(values)
                return
            named = dict(zip(layout, values))
        for name, value in (named or {}).items():
            node.inputs.setdefault(name, Literal(value, f"{node.id}.{name}"))

    # ---- links through reroutes, primitives, subgraph outputs and bypassed nodes -------------------------------
    def _resolve(self, v: Link, depth: int) -> Link | Literal | None:
        if depth > MAX_NODES:
            raise GraphError(f"the links through node {v.node} form a loop")
        key = (v.node, v.slot)
        if key in self.aliases:
            target = self.aliases[key]
            return self._resolve(target, depth + 1) if isinstance(target, Link) else target
        if v.node in self.bypassed:
            raw, inputs = self.bypassed[v.node]
            outputs = raw.get("outputs") or []
            want = outputs[v.slot].get("type") if v.slot < len(outputs) else None
            for inp in raw.get("inputs") or []:
                if inp.get("type") == want and inp.get("name") in inputs:
                    src = inputs[inp["name"]]
                    return self._resolve(src, depth + 1) if isinstance(src, Link) else src
            return None
        if v.node in self.muted:
            return None
        if v.node not in self.nodes:
            raise GraphError(f"a link comes from node {v.node}, which the graph does not have")
        return v


def _link_table(links) -> dict[int, tuple[int, int, int, int]]:
    """{link id: (origin node id, origin slot, target node id, target slot)} from the top level's arrays or a
    subgraph's objects."""
    out = {}
    for link in links:
        if isinstance(link, Mapping):
            out[link["id"]] = (link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"])
        elif isinstance(link, list) and len(link) >= 5:
            out[link[0]] = (link[1], link[2], link[3], link[4])
    return out
