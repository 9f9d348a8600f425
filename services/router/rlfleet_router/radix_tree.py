"""A radix tree over prompts recording which engines (tenants) hold which prefixes, in bounded memory.

Keys are sequences compared element by element: token ids, or strings when a request carries text
(one character then counts as one token). Token ids are stored as 32-bit ints in `array("i")`, 4
bytes a token (a tuple of Python ints costs about 37); `token_key` builds that form, and `insert` and
`match` convert any other sequence of ints (a tuple in a notebook) to it, so every token-id edge has
one type: an array never equals a tuple. Both kinds live in one tree without colliding, since an int
never equals a one-character string.

Memory is bounded by one global budget, shared by every tenant, on the tokens stored in edges plus
`node_tokens` (NODE_TOKENS) for each node, its own memory: when an insert takes the tree over
`max_tokens`, the least recently used leaves are evicted (with all their tenants) until it fits again.
A node (its edge's array, its dict of children, its set of tenants, its LRU entry) costs about 0.8 KB,
which is 200 tokens of 4 bytes: counted so, the budget bounds the memory whatever the prompts' shape,
about 5 bytes a unit; counting tokens alone, prompts that part at every token cost 400 bytes a token.
The budget is global rather than per engine so that the router's memory does not grow with the
fleet, and so that a hot prefix shared by many engines is stored once. The tree also remembers, per
tenant, where each inserted key ended, so a match tells which earlier prompt a key repeats or
continues, not only how much of it a tenant holds.

Exact LRU in O(1) per touched node: every node (but the root) sits in one ordered dict, and a
touched path is moved to the end leaf first, then parent, then grandparent. A parent therefore
always comes after all of its children, so the first node in the order has no children: it is the
least recently used leaf. Usable alone (no router types), e.g. in notebooks or other routers.
"""

from __future__ import annotations

import struct
from array import array
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TypeAlias

NODE_TOKENS = 200
"""What a node costs in the budget beyond its edge's tokens: its own memory (about 0.8 KB) in tokens of 4 bytes."""

TokenKey: TypeAlias = "array[int]"  # a string: array is not subscriptable at run time before Python 3.12
"""Token ids as the tree stores them: `array("i")`, 32-bit signed ints."""
Key: TypeAlias = str | Sequence[int]
"""What `insert` and `match` take: text, or token ids (fastest as a `TokenKey`, stored as one anyway)."""


def token_key(ids: Sequence[int]) -> TokenKey:
    """`ids` as the tree stores them; ValueError if one is not an int of 32 bits (a malformed request)."""
    try:
        # struct converts a list of ints about twice as fast as array() does (15 vs 31 us for 2k ids).
        return array("i", struct.pack(f"{len(ids)}i", *ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be 32-bit ints: {exc}") from None


def _stored_form(key: Key) -> str | TokenKey:
    if isinstance(key, str) or (isinstance(key, array) and key.typecode == "i"):
        return key
    return token_key(key)


class _Node:
    __slots__ = ("key", "children", "parent", "tenants", "ends")

    def __init__(self, key: str | TokenKey, parent: _Node | None) -> None:
        # The edge from the parent: never empty except at the root. Always a slice, so a copy: the caller's
        # array (mutable, unlike a tuple) is never stored.
        self.key = key
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.tenants: set[str] = set()
        self.ends: set[str] | None = None  # tenants a whole inserted key ended here for (None: none)


@dataclass(frozen=True)
class PrefixMatch:
    """The longest prefix of a key each tenant holds (tenants holding none of it are absent)."""

    length: int
    """Length of the key that was matched against."""
    matched: dict[str, int]
    """Tenant -> tokens of the key's prefix it holds."""
    extended: dict[str, int]
    """Tenant -> length of the longest prefix of the key that was itself inserted whole for the tenant: an
    earlier prompt this key repeats or continues (a conversation's previous turn, a group's earlier sample)."""

    def best(self, tenants: Sequence[str]) -> tuple[str | None, int]:
        """Among `tenants`, the one holding the longest prefix and that length ((None, 0) if none holds any)."""
        best, longest = None, 0
        for tenant in tenants:
            length = self.matched.get(tenant, 0)
            if length > longest:
                best, longest = tenant, length
        return best, longest


def common_length(key: str | TokenKey, start: int, edge: str | TokenKey) -> int:
    """Length of the common prefix of key[start:] and edge, by C-level slice compares (O(log n) of them)."""
    n = min(len(edge), len(key) - start)
    if key[start : start + n] == edge[:n]:
        return n
    low, high = 0, n - 1  # the common length is in [low, high]; high < n since the full slices differ
    while low < high:
        mid = (low + high + 1) // 2
        if key[start : start + mid] == edge[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class RadixTree:
    def __init__(self, max_tokens: int, node_tokens: int = NODE_TOKENS) -> None:
        if node_tokens < 0:
            raise ValueError(f"node_tokens must be >= 0, got {node_tokens}")
        if max_tokens <= node_tokens:
            raise ValueError(f"max_tokens must be above what one node costs ({node_tokens}), got {max_tokens}")
        self.max_tokens = max_tokens
        self.node_tokens = node_tokens
        self.tokens = 0
        self.evictions = 0
        self._root = _Node("", None)
        self._lru: OrderedDict[_Node, None] = OrderedDict()

    @property
    def nodes(self) -> int:
        return len(self._lru)

    @property
    def used(self) -> int:
        """What the budget counts: the tokens in edges plus `node_tokens` a node."""
        return self.tokens + self.node_tokens * len(self._lru)

    def insert(self, key: Key, tenant: str) -> None:
        """Records that `tenant` holds `key` (and so every prefix of it) and that `key` ended there; may evict
        other prefixes. ValueError if `key` holds token ids beyond 32 bits."""
        key = _stored_form(key)
        if len(key) > self.max_tokens - self.node_tokens:
            key = key[: self.max_tokens - self.node_tokens]
        node, pos, end = self._root, 0, len(key)
        while pos < end:
            child = node.children.get(key[pos])
            if child is None:
                child = _Node(key[pos:], node)
                node.children[key[pos]] = child
                self.tokens += end - pos
                node = child
                break
            edge = child.key
            if key[pos : pos + len(edge)] == edge:
                pos += len(edge)
            else:
                common = common_length(key, pos, edge)  # < len(edge) here: the edge is cut in two
                child = self._split(child, common)
                pos += common
            node = child
        if node.parent is not None:
            if node.ends is None:
                node.ends = set()
            node.ends.add(tenant)
        lru = self._lru
        while node.parent is not None:  # up to, not including, the root; leaf first: see the module docstring
            node.tenants.add(tenant)
            if node in lru:
                lru.move_to_end(node)
            else:
                lru[node] = None
            node = node.parent
        while self.used > self.max_tokens:
            self._evict_lru_leaf()

    def match(self, key: Key) -> PrefixMatch:
        """How much of `key` each tenant holds. Read-only: a match alone does not make a prefix recent.
        ValueError if `key` holds token ids beyond 32 bits."""
        key = _stored_form(key)
        matched: dict[str, int] = {}
        extended: dict[str, int] = {}
        node, pos = self._root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            common = common_length(key, pos, child.key)
            pos += common
            for tenant in child.tenants:
                matched[tenant] = pos
            if common < len(child.key):
                break
            for tenant in child.ends or ():
                extended[tenant] = pos
            node = child
        return PrefixMatch(length=len(key), matched=matched, extended=extended)

    def remove_tenants(self, tenants: Collection[str]) -> None:
        """Forgets everything `tenants` hold (engines left, or lost their caches) in one walk over the nodes
        they hold; when they are all the tree's tenants (a fleet-wide flush), empties it at once."""
        gone = set(tenants)
        # A tenant held by a node is held by all its ancestors: the root's children hold every tenant.
        if all(child.tenants <= gone for child in self._root.children.values()):
            self._clear()
            return
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.tenants.isdisjoint(gone):
                continue
            node.tenants -= gone
            if node.ends is not None:
                node.ends -= gone
            if node.tenants:
                stack.extend(node.children.values())
            else:
                self._drop_subtree(node)  # nobody holds this subtree

    def _clear(self) -> None:
        self._root = _Node("", None)
        self._lru.clear()
        self.tokens = 0

    def _split(self, child: _Node, at: int) -> _Node:
        """Cuts `child`'s edge after `at` elements; returns the new upper node (same tenants, same LRU slot)."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper = _Node(child.key[:at], parent)
        upper.tenants = set(child.tenants)
        parent.children[child.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        self._lru[upper] = None  # after the lower half, as a parent must be; the insert moves the path anyway
        return upper

    def _evict_lru_leaf(self) -> None:
        leaf, _ = self._lru.popitem(last=False)
        assert not leaf.children and leaf.parent is not None, "the LRU order keeps leaves first"
        del leaf.parent.children[leaf.key[0]]
        self.tokens -= len(leaf.key)
        self.evictions += 1

    def _drop_subtree(self, node: _Node) -> None:
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            self._lru.pop(current, None)
            self.tokens -= len(current.key)
