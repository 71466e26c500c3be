import sys
from mkgen.spec.loader import load_spec
from mkgen.spec.schema import MtpDraft
spec = load_spec("kimi-k2")
attn = spec.attention_table()[-1]; ffn = spec.ffn_table()[-1]
spec = spec.model_copy(update={"draft": MtpDraft(kind="mtp", layers=1, attention=attn, ffn=ffn)})
open("/tmp/fz/kimi-k2-mtp.yaml", "w").write(__import__("yaml").safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False))
print(attn, ffn)
