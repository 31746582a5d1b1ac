"""`python -m serving.proto`: regenerate the committed stubs in place."""

from serving.proto import PROTO, generate

for path in generate(PROTO.parents[2]):
    print(f"wrote {path}")
