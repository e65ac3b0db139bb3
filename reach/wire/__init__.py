"""The wire: what travels between participants, and the contracts it is checked against.

- ``subjects``: every NATS subject and bucket name the fabric uses;
- ``envelope``: a request's and a reply's headers and body (docs/protocol.md);
- ``codec``: payloads as msgpack or JSON, the size limits;
- ``models``: the manifest, instance records and heartbeats (pydantic), and the
  errors of a model that does not validate;
- ``modelcodec``: those models encoded and decoded the fast way;
- ``contract``: a capability's input and output JSON Schemas, compiled and checked;
- ``schemacheck``: a schema checked to be valid Draft 2020-12 before it is compiled;
- ``schemas``: the JSON Schemas of the wire, as ``reach schema export`` writes them;
- ``plain``: the base of the small value classes built on every call.
"""
