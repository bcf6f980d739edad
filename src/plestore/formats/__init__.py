"""Row formats: how one table row is stored as bytes, and how it becomes bf16 (fp16 / fp32
rows stay what they are: they serve float16 / float32 models exactly).

Every format has one numpy decode and one torch decode (any device) that are bit-identical for
every non-NaN value (NaN stays NaN; its payload bits may differ between backends). The numpy
decode returns float32 arrays holding exactly the decoded values, since numpy has no bf16.

Dequant follows what the engines (SGLang, vLLM) compute:

| format      | row bytes (dim d)        | value                                              |
|-------------|--------------------------|----------------------------------------------------|
| `bf16`      | 2d                       | the bf16 itself                                    |
| `fp8_e4m3`  | d                        | bf16(bf16(e4m3) * bf16(table scale))               |
| `nvfp4`     | d/2 codes + d/16 scales  | bf16(fp32(fp4 * e4m3 block scale) * fp32 scale)    |
| `fp8_ue8m0` | d + d/32 scales          | bf16(fp32(e4m3) * 2^(byte-127)); the byte is       |
|             |                          | shifted into the fp32 exponent: 0 -> 0, 255 -> inf |
| `nf4`       | d/2 codes + fp16 + 2 pad | bf16(fp32(NF4_LEVELS[code]) * fp32(fp16 scale))    |
| `fp16`      | 2d                       | the float16 itself (decodes to float16)            |
| `fp32`      | 4d                       | the float32 itself (decodes to float32)            |

Packed nibbles: element 2i is the low nibble of byte i, element 2i+1 the high nibble.
"""

from plestore.formats.base import Encoded, EncodeError, RowFormat
from plestore.formats.codecs import E4M3_LUT, NF4_LEVELS, bf16_round
from plestore.formats.kinds import FORMATS, get_format

__all__ = [
    "E4M3_LUT",
    "FORMATS",
    "NF4_LEVELS",
    "EncodeError",
    "Encoded",
    "RowFormat",
    "bf16_round",
    "get_format",
]
