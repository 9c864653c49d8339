"""ComfyUI graphs as render requests (docs/workflows.md).

`read_workflow` reads a graph in the editor's format (subgraphs flattened) or the API format; `interpret` runs it
symbolically from its saving node through the table of nodes this product runs (`nodes.NODES`) and gives the
render it stands for (`WorkflowRender`, each value with where it came from) or every reason it cannot run here
(`WorkflowRefused`). Torch-free: the thin client refuses a graph before anything starts, and the render service
reads the same graph the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

from minimax_h3.comfy.graph import Graph, GraphError
from minimax_h3.comfy.graph import parse_graph as _parse_graph
from minimax_h3.comfy.nodes import (NODES, REFUSED, Interpretation, MediaRef, Refusal, Val, WorkflowRefused,
                                    WorkflowRender, attribute, interpret, widget_layouts)

__all__ = ["NODES", "REFUSED", "Graph", "GraphError", "Interpretation", "MediaRef", "Refusal", "Val",
           "WorkflowRefused", "WorkflowRender", "attribute", "interpret", "read_workflow"]


def read_workflow(data: bytes | str | Mapping) -> Graph:
    """A graph in ComfyUI's UI or API format (JSON text or its parsed object)."""
    return _parse_graph(data, widget_layouts)
