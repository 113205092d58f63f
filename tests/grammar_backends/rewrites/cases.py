"""Hand-written schemas for the exact rewrites (``grammar_backends/rewrites/``): what each becomes
and which rewrites apply (``HAND``), what no exact rewrite touches (``LEFT_ALONE``), and what no
value matches, with the reason the refusal gives (``MATCH_NOTHING``)."""

from __future__ import annotations

DRAFT_4 = "http://json-schema.org/draft-04/schema#"
DRAFT_7 = "http://json-schema.org/draft-07/schema#"

HAND = {  # (schema, what it becomes, the rewrites applied)
    "double negation": (
        {"not": {"not": {"type": "string", "minLength": 2}}},
        {"type": "string", "minLength": 2},
        ["double negation"],
    ),
    "double negation beside keywords": (
        {"type": "string", "not": {"not": {"maxLength": 3}}},
        {"type": "string", "allOf": [{"maxLength": 3}]},
        ["double negation"],
    ),
    "an enum beside a type none of its values has: the optional property is left out": (
        {"type": "object", "properties": {"a": {"type": "string"}, "b": {"enum": ["M", "D"], "type": "object"}}},
        {"type": "object", "properties": {"a": {"type": "string"}, "b": False}},
        ["finite values"],
    ),
    "a const beside a type it does not have, in an anyOf": (
        {"anyOf": [{"type": "integer", "const": "x"}, {"type": "string", "maxLength": 3}]},
        {"anyOf": [{"type": "string", "maxLength": 3}]},
        ["finite values", "nothing matches"],
    ),
    "an enum narrowed by its type": (
        {"type": "string", "enum": ["a", 1, None]},
        {"enum": ["a"]},
        ["finite values"],
    ),
    "enum narrowed by a pattern": (
        {"enum": ["ab", "b", "abc"], "pattern": "^a"},
        {"enum": ["ab", "abc"]},
        ["finite values"],
    ),
    "allOf of an enum and a not": (
        {"allOf": [{"enum": [1, "x", None]}, {"not": {"type": "string"}}]},
        {"enum": [1, None]},
        ["not of a type", "finite values"],
    ),
    "not of a type": (
        {"type": ["string", "integer", "null"], "not": {"type": "null"}},
        {"type": ["string", "integer"]},
        ["not of a type"],
    ),
    "dependencies, both forms": (
        {"type": "object", "dependencies": {"a": ["b"], "c": {"required": ["d"]}}},
        {
            "type": "object",
            "allOf": [
                {"anyOf": [{"properties": {"a": False}}, {"required": ["a", "b"]}]},
                {"anyOf": [{"properties": {"c": False}}, {"allOf": [{"required": ["c"]}, {"required": ["d"]}]}]},
            ],
        },
        ["dependencies"],
    ),
    "dependentRequired": (
        {"dependentRequired": {"x": ["y", "z"]}},
        {"allOf": [{"anyOf": [{"properties": {"x": False}}, {"required": ["x", "y", "z"]}]}]},
        ["dependencies"],
    ),
    "not of number removes integer": (
        {"not": {"type": "number"}},
        {"type": ["null", "boolean", "object", "array", "string"]},
        ["not of a type"],
    ),
    "not of required": (
        {"type": "object", "not": {"required": ["a", "b"]}},
        {
            "type": "object",
            "anyOf": [{"type": "object", "properties": {"a": False}}, {"type": "object", "properties": {"b": False}}],
        },
        ["not"],
    ),
    "not of string values": (
        {"type": "string", "not": {"enum": ["ab", "b"]}},
        {"type": "string", "pattern": r"^(|[^ab][\s\S]*|a((|[^b][\s\S]*|b(([\s\S]+))))|b(([\s\S]+)))$"},
        ["not"],
    ),
    "not of a range": (
        {"type": "number", "not": {"minimum": 1, "maximum": 5}},
        {
            "type": "number",
            "anyOf": [{"type": "number", "exclusiveMaximum": 1}, {"type": "number", "exclusiveMinimum": 5}],
        },
        ["not"],
    ),
    "not of anyOf": (
        {"not": {"anyOf": [{"type": "string"}, {"minimum": 3}]}},
        {
            "allOf": [
                {"type": ["null", "boolean", "object", "array", "number"]},
                {"type": "number", "exclusiveMaximum": 3},
            ]
        },
        ["not"],
    ),
    "not of a character class": (
        {"type": "string", "not": {"pattern": r"^[\s.]+$"}},
        {"type": "string", "anyOf": [{"type": "string", "pattern": r"[^\s.]"}, {"type": "string", "maxLength": 0}]},
        ["not"],
    ),
    "not of a property": (
        {"type": "object", "not": {"properties": {"a": {"type": "string"}}, "required": ["a"]}},
        {
            "type": "object",
            "anyOf": [
                {
                    "type": "object",
                    "required": ["a"],
                    "properties": {"a": {"type": ["null", "boolean", "object", "array", "number"]}},
                },
                {"type": "object", "properties": {"a": False}},
            ],
        },
        ["not"],
    ),
    "not of nothing": (
        {"type": "object", "properties": {"a": {"not": {}}}},
        {"type": "object", "properties": {"a": False}},
        ["not"],
    ),
    "if/then/else": (
        {
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]},
            "else": {"required": ["c"]},
        },
        {
            "anyOf": [
                {"properties": {"a": {"const": 1}}, "required": ["a", "b"]},
                {
                    "anyOf": [
                        {
                            "type": "object",
                            "required": ["a"],
                            "properties": {
                                "a": {
                                    "anyOf": [
                                        {"type": ["null", "boolean", "object", "array", "string"]},
                                        {"type": "number", "exclusiveMaximum": 1},
                                        {"type": "number", "exclusiveMinimum": 1},
                                    ]
                                }
                            },
                        },
                        {"type": "object", "properties": {"a": False}},
                    ],
                    "required": ["c"],
                },
            ]
        },
        ["if/then/else"],
    ),
    "oneOf of one branch": (
        {"type": "object", "oneOf": [{"required": ["a"]}]},
        {"type": "object", "required": ["a"]},
        ["oneOf of one branch"],
    ),
    "oneOf of disjoint branches": (
        {
            "type": "object",
            "required": ["kind"],
            "oneOf": [{"properties": {"kind": {"const": "a"}}}, {"properties": {"kind": {"const": "b"}}}],
        },
        {
            "type": "object",
            "required": ["kind"],
            "anyOf": [{"properties": {"kind": {"const": "a"}}}, {"properties": {"kind": {"const": "b"}}}],
        },
        ["oneOf of disjoint branches"],
    ),
    "oneOf of finite branches": (
        {"oneOf": [{"enum": [1, 2]}, {"$ref": "#/definitions/x"}], "definitions": {"x": {"enum": [2, 3]}}},
        {"definitions": {"x": {"enum": [2, 3]}}, "enum": [1, 3]},
        ["oneOf of finite branches"],
    ),
    "oneOf by negation": (
        {"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {
            "type": "object",
            "anyOf": [
                {"required": ["a"], "type": "object", "properties": {"b": False}},
                {"required": ["b"], "type": "object", "properties": {"a": False}},
            ],
        },
        ["oneOf by negation"],
    ),
    "unknown format": ({"type": "string", "format": "counter"}, {"type": "string"}, ["unknown format"]),
    "annotations beside $ref": (
        {"$ref": "#/definitions/x", "alias": "y", "definitions": {"x": {"type": "string"}}},
        {"$ref": "#/definitions/x", "definitions": {"x": {"type": "string"}}},
        ["annotations beside $ref"],
    ),
    "keywords beside $ref": (
        {"$ref": "#/definitions/x", "maxLength": 3, "definitions": {"x": {"type": "string"}}},
        {"maxLength": 3, "definitions": {"x": {"type": "string"}}, "allOf": [{"$ref": "#/definitions/x"}]},
        ["keywords beside $ref"],
    ),
    "keywords beside $ref its target repeats": (
        {"$schema": DRAFT_4, "$ref": "#/definitions/x", "type": "string", "definitions": {"x": {"type": "string"}}},
        {"$schema": DRAFT_4, "$ref": "#/definitions/x", "definitions": {"x": {"type": "string"}}},
        ["keywords beside $ref its target repeats"],
    ),
    "bounded integers": (
        {"type": "integer", "minimum": 1, "exclusiveMaximum": 11, "not": {"multipleOf": 3}},
        {"enum": [1, 2, 4, 5, 7, 8, 10]},
        ["bounded integers"],
    ),
    "min/maxProperties of a closed object": (
        {
            "type": "object",
            "properties": {"a": {}, "b": {}, "c": {}},
            "required": ["a"],
            "additionalProperties": False,
            "minProperties": 2,
            "maxProperties": 2,
        },
        {
            "type": "object",
            "properties": {"a": {}, "b": {}, "c": {}},
            "required": ["a"],
            "additionalProperties": False,
            "anyOf": [{"required": ["b"]}, {"required": ["c"]}],
            "allOf": [{"anyOf": [{"properties": {"b": False}}, {"properties": {"c": False}}]}],
        },
        ["min/maxProperties of a closed object"],
    ),
    "not beside a $ref, draft 7": (
        {
            "$schema": DRAFT_7,
            "$ref": "#/definitions/x",
            "not": {"required": ["a"]},
            "definitions": {"x": {"type": "object"}},
        },
        {
            "$schema": DRAFT_7,
            "$ref": "#/definitions/x",
            "definitions": {"x": {"type": "object"}},
            "allOf": [{"type": "object", "properties": {"a": False}}],
        },
        ["not"],
    ),
    "not of propertyNames, as written": (
        {"type": "object", "not": {"propertyNames": {"not": {"enum": ["a", "b"]}}}},
        {"type": "object", "anyOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]},
        ["not", "not"],
    ),  # (the inner not, rewritten on its own, is not what the outer one negates)
}
LEFT_ALONE = {  # no exact rewrite: left for the backend to refuse
    "not integer": {"not": {"type": "integer"}},
    "not of a pattern": {"type": "string", "not": {"pattern": "^a"}},
    "an enum beside its type": {"type": "string", "enum": ["a", "b"]},
    "an enum with a $ref": {"enum": ["a"], "allOf": [{"$ref": "#/definitions/x"}], "definitions": {"x": {}}},
    "an enum with a format": {"enum": ["a"], "format": "email", "minLength": 1},
    "keywords beside $ref in draft 7": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$ref": "#/definitions/x",
        "maxLength": 3,
        "definitions": {"x": {"type": "string"}},
    },
    "oneOf of overlapping strings": {"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "string"}]},
    "a draft-3 format in a draft-3 schema": {
        "$schema": "http://json-schema.org/draft-03/schema#",
        "type": "string",
        "format": "host-name",
    },
    "bounded integers in draft 4": {
        "$schema": DRAFT_4,
        "type": "integer",
        "minimum": 1,
        "maximum": 3,
        "not": {"multipleOf": 2},
    },
    "not of an object value": {"not": {"const": {"a": 1}}},
    "not of a multipleOf": {"type": "number", "not": {"multipleOf": 2}},
    "if of a pattern": {"if": {"pattern": "^a"}, "then": {"maxLength": 2}},
    "bounded integers beside a $ref, draft 7": {
        "$schema": DRAFT_7,
        "$ref": "#/definitions/x",
        "type": "integer",
        "minimum": 1,
        "maximum": 3,
        "not": {"multipleOf": 2},
        "definitions": {"x": {}},
    },
    "oneOf of typed values in draft 4": {
        "$schema": DRAFT_4,
        "oneOf": [{"type": "integer", "enum": [1, 2]}, {"enum": [2, 3]}],
    },
    "minProperties of an open object": {"type": "object", "properties": {"a": {}}, "minProperties": 1},
    "not of a recursive reference": {
        "not": {"$ref": "#/definitions/t"},
        "definitions": {"t": {"properties": {"a": {"$ref": "#/definitions/t"}}, "required": ["a"]}},
    },
}


MATCH_NOTHING = {  # (schema, what the refusal says)
    "no value left": ({"enum": ["a"], "minLength": 2}, 'none of the values ["a"] fits the minLength'),
    "a required property whose enum contradicts its type": (
        {
            "type": "object",
            "properties": {"builtin": {"enum": ["MODIFIABLE", "DELETABLE", "IMMUTABLE"], "type": "object"}},
            "required": ["builtin"],
        },
        "required property 'builtin' can have no value",
    ),
    "an allOf with a branch of no value": (
        {"allOf": [{"type": "string"}, {"const": 3, "type": "string"}]},
        "a branch of an allOf matches nothing",
    ),
    "an array that needs an item of no value": (
        {"type": "array", "items": {"enum": [1], "type": "string"}, "minItems": 1},
        "items matches nothing",
    ),
}
