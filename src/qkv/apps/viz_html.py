"""One self-contained interactive attention page (what ``qkv plot --html FILE`` writes).

The page is :mod:`qkv.doctor.view`'s canvas view (the same renderer the attention doctor's
captures use): one map per (kind, layer, head), grouped by kind and layer (encoder self, decoder
self, cross; a decoder-only model has decoder self only). The reader picks the group and the head,
zooms and pans, and hovers a cell to read its query token, key token and weight: the float32
value the model produced (shown as the shortest decimal that reads back to it) for maps of up to
65,536 cells, an 8-bit log code within a stated relative error beyond. It opens from disk
(``file://``) with no server and no network; the selection lives in the URL hash
(``#map=5&scale=linear``), so a link opens the same view.
"""

from __future__ import annotations

from pathlib import Path

from qkv.apps.recording import AttentionMaps, select_kinds
from qkv.doctor.view import HeadMap, attention_html, save_attention_html

__all__ = ["attention_page", "head_maps", "write_attention_page"]


def head_maps(maps: AttentionMaps, kinds: tuple[str, ...] | None = None) -> list[HeadMap]:
    """The page's maps: one per kind, layer and head, in that order.

    Args:
        maps: from :func:`qkv.apps.recording.attention_maps`.
        kinds: which kinds to include, in order (default: all the model has).

    Returns:
        :class:`~qkv.doctor.view.HeadMap` objects titled ``"cross · layer 1 · head 0"``, grouped
        by ``"cross · layer 1"``, labelled with the query and key tokens.

    Raises:
        ValueError: an unknown kind, one the model does not have, or no kinds at all.
    """
    out = []
    for kind in select_kinds(maps, kinds):
        for layer, weights in enumerate(maps.weights[kind]):  # each [H, T, S]
            group = f"{kind} · layer {layer}"
            for head in range(weights.shape[0]):
                out.append(
                    HeadMap(
                        title=f"{group} · head {head}",
                        weights=weights[head],  # [T, S]
                        query_labels=maps.queries[kind],
                        key_labels=maps.keys[kind],
                        group=group,
                    )
                )
    return out


def attention_page(
    maps: AttentionMaps, kinds: tuple[str, ...] | None = None, title: str = ""
) -> str:
    """The whole HTML page: CSS, JavaScript and data inline, nothing fetched.

    Args:
        maps: from :func:`qkv.apps.recording.attention_maps`.
        kinds: which kinds the reader can pick (default: all the model has).
        title: the page's heading.

    Returns:
        The page's text.

    Raises:
        ValueError: as :func:`head_maps`.
    """
    return attention_html(head_maps(maps, kinds), title)


def write_attention_page(
    maps: AttentionMaps, path: str | Path, kinds: tuple[str, ...] | None = None, title: str = ""
) -> Path:
    """Write :func:`attention_page` to ``path`` (UTF-8), creating its folder.

    Returns:
        The path written.

    Raises:
        ValueError: as :func:`head_maps`.
    """
    return save_attention_html(path, head_maps(maps, kinds), title)
