// SPDX-License-Identifier: Apache-2.0
// Byte-level BPE tokenizer (GPT-2 family) built from plain vocabulary data, as a GGUF file's
// `tokenizer.ggml.*` metadata holds it (model "gpt2"): the tokens, their types, the merges in rank
// order, the pre-tokenizer name and the special token ids. Written for SmolLM2-135M-Instruct and
// tested against the tokenizer transformers 5.2 builds from that GGUF
// (tests/engine/test_bpe_tokenizer.cpp, fixture from tools/model/make_tokenizer_fixture.py).
//
// Encoding, in order:
//  1. special tokens: with `parse_special`, every occurrence of a control (type 3) or user-defined
//     (type 4) token's text becomes that token, leftmost first and longest at one position (the
//     tokenizers library's added-token split); the text between them goes through steps 2-4;
//  2. pre-tokenizer: the GPT-2 regex
//       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     implemented as a hand-written scanner (no regex engine); `\s` is the White_Space property.
//     The classes come from a generated, committed table (unicode_classes.inc, written by
//     tools/model/gen_unicode_classes.py by probing the tokenizers library's own regex per code point:
//     Unicode 16.0, which a Unicode 14.0 table from Python 3.11's unicodedata misses on 2 fixture
//     strings). Pre type "smollm-digits" first splits off every \p{N} character on its own (llama.cpp's
//     reading of pre type "smollm"; see from_vocab);
//  3. byte-to-unicode: each byte of a piece becomes the printable character GPT-2 assigns it;
//  4. BPE: the piece's characters are merged pairwise, lowest merge rank first, leftmost among equal
//     ranks, until no ranked pair is left. A character without a token falls back to the `<0xXX>`
//     tokens of its UTF-8 bytes when the vocabulary has them all, else to the unknown token
//     (consecutive unknown characters of a piece fused into one, as with fuse_unk).
// Decoding concatenates the token texts (control and user-defined tokens verbatim, `<0xXX>` tokens as
// their byte) and maps the byte-level characters back to bytes. No space clean-up is applied
// (transformers' decode deletes the space before '.', ',', "n't", ... by default; this does not), so
// decode(encode(s)) == s for every valid UTF-8 string whose characters all have tokens.
//
// Against transformers 5.2's tokenizer for SmolLM2's GGUF (tools/model/README.md has the details): ids
// equal on all 1,069 fixture strings with pre type "smollm"; no BOS is ever added (transformers' plain
// encode prepends <|im_start|>); the five fill-in-the-middle tokens transformers adds past the vocabulary
// (ids 49152..49156) are plain text here; decode does no space clean-up.
//
// Thread-safety: immutable after construction; encode/decode may run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvpolicy/core/version.hpp"

KVP_NAMESPACE_BEGIN
namespace io {
class GgufFile;
}
KVP_NAMESPACE_END

namespace kvp_engine {

/// Token types of GGUF's `tokenizer.ggml.token_type` (llama.cpp's enum).
enum class TokenType : std::int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

/// Ids of the special tokens; -1 where the model has none.
struct SpecialTokens {
  std::int32_t bos = -1;
  std::int32_t eos = -1;
  std::int32_t unk = -1;
  std::int32_t pad = -1;
};

/// One chat turn (role "system", "user", "assistant", ... and its text).
struct ChatMessage {
  std::string role;
  std::string content;
};

/// How the text between special tokens is split before BPE.
enum class PreTokenizer {
  kGpt2,        ///< the GPT-2 regex (pre types "gpt2", "smollm": what transformers applies to both)
  kGpt2Digits,  ///< every \p{N} character split off first, then the GPT-2 regex ("smollm-digits")
};

/// SmolLM2-Instruct's chat template, byte for byte as its GGUF's `tokenizer.chat_template` holds it:
/// ChatML, with a default system prompt inserted when the first message is not a system message. (The
/// Jinja string literals hold real newline characters, written \n here.)
inline constexpr std::string_view kSmolLM2ChatTemplate =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a "
    "helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + "
    "'\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' "
    "}}{% endif %}";

class BpeTokenizer {
 public:
  /// Builds the tokenizer from plain data; throws std::runtime_error naming the offending entry on bad data.
  ///
  /// `tokens[i]` is the text of id i in the byte-level alphabet (e.g. "Ġthe" for " the"); `merges[r]` is
  /// "left right" (one space) with rank r; `token_types` is empty (all kNormal) or one TokenType value per
  /// token. `pre` is "gpt2" or "smollm" (both the GPT-2 regex: transformers 5.2 builds a ByteLevel
  /// pre-tokenizer for every GGUF of model "gpt2", whatever its pre type) or "smollm-digits" (llama.cpp's
  /// "smollm": \p{N} split off individually first, as SmolLM2's own tokenizer.json does). The two differ
  /// on, e.g., "a  123" (transformers: "a", " ", " 123"; digits: "a", "  ", "1", "2", "3") and on non-ASCII
  /// digits after a space. `special` ids must be -1 or valid ids. `chat_template` is the model's template
  /// text (GGUF `tokenizer.chat_template`; may be empty).
  ///
  /// Errors: empty vocabulary, more than 2^31-1 tokens, an empty or duplicate token, a token type outside
  /// 0..6, a `token_types` size different from `tokens`, a merge that is not two non-empty parts separated
  /// by one space, names a token not in the vocabulary, whose concatenation is not a token, or repeats an
  /// earlier merge, an unknown `pre`, a special id out of range.
  /// Complexity: O(total token bytes + merges) expected.
  static BpeTokenizer from_vocab(std::vector<std::string> tokens, const std::vector<std::string>& merges,
                                 std::vector<std::int32_t> token_types, std::string pre, SpecialTokens special,
                                 std::string chat_template = {});

  /// From a GGUF file's metadata (kvpolicy/io/gguf.hpp): `tokenizer.ggml.model` must be "gpt2";
  /// `tokenizer.ggml.tokens` and `tokenizer.ggml.merges` are required; `tokenizer.ggml.token_type`,
  /// `tokenizer.ggml.pre` (default "gpt2"), `tokenizer.ggml.{bos,eos,unknown,padding}_token_id` (default -1)
  /// and `tokenizer.chat_template` are optional. Throws std::runtime_error naming the key for a missing or
  /// mistyped entry, then as from_vocab. For SmolLM2-135M-Instruct: 49,152 tokens, 48,900 merges, pre
  /// "smollm", bos 1 (<|im_start|>), eos 2 (<|im_end|>), unk 0 (<|endoftext|>), pad 2.
  static BpeTokenizer from_gguf(const kvpolicy::io::GgufFile& file);

  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  ~BpeTokenizer();

  /// Token ids of `text` (steps 1-4 of the file comment); no BOS is added. `parse_special` = false
  /// tokenizes special-token texts like any other text. Bytes that are not valid UTF-8 are classed as
  /// "other" characters one byte each. Throws std::runtime_error when a character has no token, no
  /// byte-fallback tokens and the model has no unknown token.
  /// Complexity: O(n log n) per pre-token piece of n bytes; repeated pieces of one call are cached.
  std::vector<std::int32_t> encode(std::string_view text, bool parse_special = true) const;

  /// The pre-tokenizer's pieces of `text` (step 2 alone: no special-token split), views into `text`.
  std::vector<std::string_view> split(std::string_view text) const;

  /// The bytes the ids stand for (see the file comment); may end inside a UTF-8 sequence when the ids
  /// do. Throws std::runtime_error naming the position of an id outside [0, vocab_size()).
  std::string decode(std::span<const std::int32_t> ids) const;

  /// Text of token `id` in the byte-level alphabet; throws std::runtime_error when out of range.
  const std::string& token(std::int32_t id) const;
  /// Id of the token whose byte-level text is `text`, or -1.
  std::int32_t id(std::string_view text) const;
  /// Type of token `id`; throws std::runtime_error when out of range.
  TokenType token_type(std::int32_t id) const;
  std::int32_t vocab_size() const noexcept;
  const SpecialTokens& special_tokens() const noexcept;
  PreTokenizer pre_tokenizer() const noexcept;
  const std::string& chat_template() const noexcept;

  /// Renders `msgs` with the model's chat template. Implemented for SmolLM2's ChatML template
  /// (kSmolLM2ChatTemplate, compared byte for byte): for each message
  /// "<|im_start|>" role "\n" content "<|im_end|>\n", preceded by the default system turn
  /// "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
  /// when the first message's role is not "system", then "<|im_start|>assistant\n" when
  /// `add_generation_prompt`. Throws std::runtime_error for any other template (there is no Jinja
  /// interpreter here). Encode the result with parse_special = true.
  std::string apply_chat_template(const std::vector<ChatMessage>& msgs, bool add_generation_prompt) const;

  /// Unicode version of the character class table ("16.0").
  static const char* unicode_version() noexcept;

 private:
  struct Impl;
  explicit BpeTokenizer(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvp_engine
