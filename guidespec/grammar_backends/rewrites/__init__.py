"""Exact rewrites of a JSON schema before a backend compiles it: each gives a schema that accepts
exactly the same JSON values, in a form the backends can enforce. Where a rewrite cannot be
exact it does nothing, and the backend refuses as before.

- **Double negation**: ``{"not": {"not": S}}`` is ``S``.
- **A finite set of values**: a schema node with ``enum`` or ``const`` (or an ``allOf`` with such
  a branch) and other keywords beside it (``type``, ``not``, ``pattern``, ``minLength``, ...)
  accepts exactly those of its values that the whole node accepts: it becomes ``enum`` of those,
  each checked by the ``jsonschema`` library against the node (nodes with a ``$ref``, or a keyword
  whose meaning depends on the draft, or ``format``, are left alone). xgrammar enforces an enum
  and drops a ``type`` beside it (``{"enum": ["M"], "type": "object"}`` accepted ``"M"``: issue 45).
  Where no value is left the node is ``false``.
- **Nothing matches**: a node that holds a part no value matches is ``false`` where that makes it
  match nothing: an object node that requires a property whose schema is ``false``, an ``allOf``
  with a ``false`` branch, an array node whose ``items`` is ``false`` and ``minItems`` positive; a
  ``false`` branch leaves an ``anyOf`` / ``oneOf`` (``false`` where none is left). A ``false``
  property that is not required stays, and the backends leave the name out. A whole schema that
  is ``false`` is refused (GrammarError, a 400) with the reason.
- **Dependencies**: ``dependencies`` / ``dependentRequired`` / ``dependentSchemas`` become, per
  name, an ``anyOf`` of "absent" (``properties: {name: false}``) and "present with what it needs"
  (xgrammar still refuses the result; llguidance enforces it, so backend ``auto`` serves it).
- **``not`` of a type**: ``{"not": {"type": T}}`` is ``type`` of the other JSON types (not where
  T names ``integer`` without ``number``: "a number that is not an integer" has no type).
- **``not``**: ``not: S`` is S's negation written with positive keywords (``negation.py``):
  ``not: {required: [a]}`` is ``properties: {a: false}``, the negation of listed strings a
  regex, of a range the ranges beside it, De Morgan for ``anyOf``/``allOf``.
- **``if``/``then``/``else``**: ``anyOf: [if and then, (not if) and else]``, where ``if`` negates.
- **``oneOf``**: as ``anyOf`` where that is exact: one branch; branches that list their values
  (the values exactly one branch accepts, as an ``enum``); branches proven pairwise disjoint
  (``disjoint.py``); else "branch i and no other", where every branch negates.
- **Unknown formats**: a ``format`` no draft defines is an annotation (dropped).
- **Beside a ``$ref``**: keywords no draft defines go; keywords the target repeats go; in a
  schema read in draft 2019-09 or later (``$schema``, or none) the rest become ``allOf`` with
  the reference. Drafts up to 7 ignore what is beside a ``$ref``: those schemas keep it, and what
  a rewrite adds to such a node stays beside the ``$ref`` as the keyword it replaces was.
- **Bounded integers**: an integer node between two bounds with a keyword a backend cannot
  enforce is the ``enum`` of its valid integers (at most 2000; not in drafts 3 and 4).
- **``minProperties``/``maxProperties`` of a closed object**: which optional names are present,
  as an ``anyOf`` of ``required`` (or absent) subsets, where there are at most 64.

``rewrite_schema`` returns the schema and the names of the rewrites applied (for the note and
the tests, which check each one's equivalence on the dataset's instances).

One module per job: ``walk.py`` (``rewrite_schema``: every node, subschemas first), ``context.py``
(the root, its draft, what was applied), ``logic.py`` (double negation, ``not``, ``if``/``then``/
``else``, ``oneOf``), ``objects.py`` (dependencies, min/maxProperties), ``refs.py`` (beside a
``$ref``), ``formats.py`` (unknown formats), ``finite.py`` (finite values, bounded integers),
``nothing_matches.py``.
"""

from guidespec.grammar_backends.rewrites.walk import REWRITES, rewrite_schema

__all__ = ["REWRITES", "rewrite_schema"]
