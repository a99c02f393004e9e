// SPDX-License-Identifier: Apache-2.0
// BpeTokenizer (bpe_tokenizer.hpp): vocabulary validation, the GPT-2 pre-tokenizer scanner, byte-level
// BPE with merge ranks, decoding and SmolLM2's chat template.
#include "bpe_tokenizer.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <functional>
#include <limits>
#include <queue>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

#include "kvpolicy/io/gguf.hpp"

namespace kvp_engine {
namespace {

enum class CharClass : std::uint8_t { kOther, kLetter, kNumber, kWhitespace };

struct CodePointRange {
  std::uint32_t lo, hi;  // inclusive
  CharClass cls;
};

#include "unicode_classes.inc"

CharClass classify(std::uint32_t cp) noexcept {
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return CharClass::kWhitespace;
    return CharClass::kOther;
  }
  const auto* end = std::end(kCodePointRanges);
  const auto* it =
      std::upper_bound(std::begin(kCodePointRanges), end, cp, [](std::uint32_t c, const CodePointRange& r) { return c < r.lo; });
  if (it == std::begin(kCodePointRanges)) return CharClass::kOther;
  --it;
  return cp <= it->hi ? it->cls : CharClass::kOther;
}

/// Decodes one UTF-8 sequence at s[i]; returns its length (1 for an invalid byte, whose code point is
/// reported as 0xFFFFFFFF and classed kOther).
std::size_t utf8_next(std::string_view s, std::size_t i, std::uint32_t* cp) noexcept {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  std::size_t len = 0;
  std::uint32_t c = 0, min = 0;
  if ((b0 & 0xE0) == 0xC0)
    len = 2, c = b0 & 0x1F, min = 0x80;
  else if ((b0 & 0xF0) == 0xE0)
    len = 3, c = b0 & 0x0F, min = 0x800;
  else if ((b0 & 0xF8) == 0xF0)
    len = 4, c = b0 & 0x07, min = 0x10000;
  if (len == 0 || i + len > s.size()) {
    *cp = 0xFFFFFFFFu;
    return 1;
  }
  for (std::size_t k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) {
      *cp = 0xFFFFFFFFu;
      return 1;
    }
    c = (c << 6) | (b & 0x3F);
  }
  if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) {
    *cp = 0xFFFFFFFFu;
    return 1;
  }
  *cp = c;
  return len;
}

void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

/// GPT-2's byte-to-unicode table: the printable bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for
/// themselves; the other 68 bytes, in increasing order, take U+0100, U+0101, ...
std::array<std::uint32_t, 256> byte_to_code_point() noexcept {
  std::array<std::uint32_t, 256> t{};
  std::uint32_t next = 256;
  for (std::uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    t[b] = printable ? b : next++;
  }
  return t;
}

constexpr std::uint32_t kMaxMappedCodePoint = 256 + 68;

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

std::uint64_t pair_key(std::int32_t a, std::int32_t b) noexcept {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
}

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error("BpeTokenizer::" + what); }

/// Printable form of a token for messages: control bytes as \xNN.
std::string quoted(std::string_view s) {
  std::string out = "'";
  for (char ch : s) {
    const auto b = static_cast<unsigned char>(ch);
    if (b < 0x20 || b == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", b);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out + "'";
}

/// The byte of a "<0xXX>" token (upper-case hex, as the tokenizers library names them), or -1.
int fallback_byte(std::string_view s) noexcept {
  if (s.size() != 6 || s.substr(0, 3) != "<0x" || s[5] != '>') return -1;
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; };
  const int hi = hex(s[3]), lo = hex(s[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

constexpr std::string_view kSmolLM2DefaultSystem =
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

}  // namespace

struct BpeTokenizer::Impl {
  struct Merge {
    std::int32_t rank;
    std::int32_t id;
  };
  struct Special {
    std::string text;
    std::int32_t id;
  };

  std::vector<std::string> tokens;
  std::vector<TokenType> types;
  std::unordered_map<std::string, std::int32_t, StringHash, std::equal_to<>> index;
  std::unordered_map<std::uint64_t, Merge> merges;
  std::array<std::string, 256> byte_chars;                  // UTF-8 of the character standing for each byte
  std::array<std::int32_t, 256> byte_token{};               // id of that character's token, or -1
  std::array<std::int32_t, 256> fallback_token{};           // id of "<0xXX>", or -1
  std::array<std::int16_t, kMaxMappedCodePoint> byte_of{};  // inverse of byte_chars, -1 where none
  std::array<std::vector<Special>, 256> specials;           // by first byte, longest first
  PreTokenizer pre = PreTokenizer::kGpt2;
  SpecialTokens special;
  std::string chat_template;

  using Cache = std::unordered_map<std::string_view, std::vector<std::int32_t>>;

  void encode_plain(std::string_view text, Cache& cache, std::vector<std::int32_t>& out) const;
  void pre_tokenize(std::string_view text, const std::function<void(std::string_view)>& emit) const;
  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const;
};

namespace {

/// The GPT-2 regex over one segment (see bpe_tokenizer.hpp); calls `emit` with each piece in order.
void gpt2_split(std::string_view s, const std::function<void(std::string_view)>& emit) {
  // Code points, their classes and byte offsets (offsets has one extra entry: s.size()).
  std::vector<std::uint32_t> cps;
  std::vector<CharClass> cls;
  std::vector<std::size_t> off;
  cps.reserve(s.size());
  cls.reserve(s.size());
  off.reserve(s.size() + 1);
  for (std::size_t i = 0; i < s.size();) {
    std::uint32_t cp;
    const std::size_t len = utf8_next(s, i, &cp);
    cps.push_back(cp);
    cls.push_back(cp == 0xFFFFFFFFu ? CharClass::kOther : classify(cp));
    off.push_back(i);
    i += len;
  }
  off.push_back(s.size());
  const std::size_t n = cps.size();
  auto run = [&](std::size_t j, CharClass c) {
    while (j < n && cls[j] == c) ++j;
    return j;
  };
  std::size_t i = 0;
  while (i < n) {
    std::size_t end = i + 1;
    const std::uint32_t c = cps[i];
    if (c == '\'' && i + 1 < n && (cps[i + 1] == 's' || cps[i + 1] == 't' || cps[i + 1] == 'm' || cps[i + 1] == 'd')) {
      end = i + 2;
    } else if (c == '\'' && i + 2 < n &&
               ((cps[i + 1] == 'r' && cps[i + 2] == 'e') || (cps[i + 1] == 'v' && cps[i + 2] == 'e') ||
                (cps[i + 1] == 'l' && cps[i + 2] == 'l'))) {
      end = i + 3;
    } else if (c == ' ' && i + 1 < n && cls[i + 1] != CharClass::kWhitespace) {
      end = run(i + 1, cls[i + 1]);  // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+" with the space
    } else if (cls[i] != CharClass::kWhitespace) {
      end = run(i, cls[i]);
    } else {
      const std::size_t j = run(i, CharClass::kWhitespace);
      // "\s+(?!\S)": a run followed by a non-space gives up its last character (which then starts the
      // next piece, e.g. " word"); a run of one followed by a non-space is taken by "\s+".
      end = (j == n || j - i == 1) ? j : j - 1;
    }
    emit(s.substr(off[i], off[end] - off[i]));
    i = end;
  }
}

}  // namespace

void BpeTokenizer::Impl::pre_tokenize(std::string_view text, const std::function<void(std::string_view)>& emit) const {
  if (pre == PreTokenizer::kGpt2) {
    gpt2_split(text, emit);
    return;
  }
  // kGpt2Digits: each \p{N} character is a piece of its own; the GPT-2 regex runs between them.
  std::size_t start = 0;
  for (std::size_t i = 0; i < text.size();) {
    std::uint32_t cp;
    const std::size_t len = utf8_next(text, i, &cp);
    if (cp != 0xFFFFFFFFu && classify(cp) == CharClass::kNumber) {
      if (i > start) gpt2_split(text.substr(start, i - start), emit);
      emit(text.substr(i, len));
      start = i + len;
    }
    i += len;
  }
  if (start < text.size()) gpt2_split(text.substr(start), emit);
}

void BpeTokenizer::Impl::encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
  // Symbols: one per byte of the piece (each byte is one character of the byte-level alphabet).
  std::vector<std::int32_t> sym;
  sym.reserve(piece.size());
  bool pending_unk = false;  // consecutive characters without a token fuse into one unknown token
  for (char ch : piece) {
    const auto b = static_cast<unsigned char>(ch);
    if (byte_token[b] >= 0) {
      if (pending_unk) sym.push_back(special.unk), pending_unk = false;
      sym.push_back(byte_token[b]);
      continue;
    }
    // Byte fallback: the "<0xXX>" tokens of the character's UTF-8 bytes, when all exist.
    const std::string& chars = byte_chars[b];
    bool all = true;
    for (char u : chars) all = all && fallback_token[static_cast<unsigned char>(u)] >= 0;
    if (all) {
      if (pending_unk) sym.push_back(special.unk), pending_unk = false;
      for (char u : chars) sym.push_back(fallback_token[static_cast<unsigned char>(u)]);
      continue;
    }
    if (special.unk < 0) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "encode: byte 0x%02X has no token, no <0xXX> fallback tokens and no unknown token", b);
      fail(buf);
    }
    pending_unk = true;
  }
  if (pending_unk) sym.push_back(special.unk);

  const std::size_t n = sym.size();
  if (n >= 2) {
    // Lowest (rank, left position) first: a min-heap of candidate pairs over a linked list of
    // symbols; an entry is stale once either side has changed.
    std::vector<std::int32_t> next(n), prev(n);
    for (std::size_t i = 0; i < n; ++i) {
      next[i] = static_cast<std::int32_t>(i + 1);
      prev[i] = static_cast<std::int32_t>(i) - 1;
    }
    next[n - 1] = -1;
    struct Cand {
      std::int32_t rank, left, right, left_id, right_id, merged;
      bool operator>(const Cand& o) const noexcept { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto push = [&](std::int32_t l, std::int32_t r) {
      if (l < 0 || r < 0) return;
      const auto it = merges.find(pair_key(sym[l], sym[r]));
      if (it != merges.end()) heap.push({it->second.rank, l, r, sym[l], sym[r], it->second.id});
    };
    for (std::size_t i = 0; i + 1 < n; ++i) push(static_cast<std::int32_t>(i), static_cast<std::int32_t>(i + 1));
    std::vector<bool> dead(n, false);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      if (dead[c.left] || dead[c.right] || next[c.left] != c.right || sym[c.left] != c.left_id || sym[c.right] != c.right_id) continue;
      sym[c.left] = c.merged;
      dead[c.right] = true;
      next[c.left] = next[c.right];
      if (next[c.right] >= 0) prev[next[c.right]] = c.left;
      push(prev[c.left], c.left);
      push(c.left, next[c.left]);
    }
    for (std::int32_t i = 0; i >= 0; i = next[i]) out.push_back(sym[i]);
  } else {
    out.insert(out.end(), sym.begin(), sym.end());
  }
}

void BpeTokenizer::Impl::encode_plain(std::string_view text, Cache& cache, std::vector<std::int32_t>& out) const {
  pre_tokenize(text, [&](std::string_view piece) {
    auto it = cache.find(piece);
    if (it == cache.end()) {
      std::vector<std::int32_t> ids;
      encode_piece(piece, ids);
      it = cache.emplace(piece, std::move(ids)).first;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
  });
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<Impl> impl) noexcept : impl_(std::move(impl)) {}
BpeTokenizer::BpeTokenizer(BpeTokenizer&&) noexcept = default;
BpeTokenizer& BpeTokenizer::operator=(BpeTokenizer&&) noexcept = default;
BpeTokenizer::~BpeTokenizer() = default;

BpeTokenizer BpeTokenizer::from_vocab(std::vector<std::string> tokens, const std::vector<std::string>& merges,
                                      std::vector<std::int32_t> token_types, std::string pre, SpecialTokens special,
                                      std::string chat_template) {
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  if (tokens.empty()) fail("from_vocab: tokens is empty");
  if (tokens.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
    fail("from_vocab: " + std::to_string(tokens.size()) + " tokens exceed the int32 id range");
  const auto n = static_cast<std::int32_t>(tokens.size());
  if (!token_types.empty() && token_types.size() != tokens.size())
    fail("from_vocab: token_types has " + std::to_string(token_types.size()) + " entries for " + std::to_string(tokens.size()) +
         " tokens (must be empty or one per token)");

  if (pre == "gpt2" || pre == "smollm")
    t.pre = PreTokenizer::kGpt2;
  else if (pre == "smollm-digits")
    t.pre = PreTokenizer::kGpt2Digits;
  else
    fail("from_vocab: pre-tokenizer " + quoted(pre) + " is not supported (known: 'gpt2', 'smollm', 'smollm-digits')");

  auto check_special = [&](const char* name, std::int32_t id) {
    if (id < -1 || id >= n)
      fail(std::string("from_vocab: special.") + name + " = " + std::to_string(id) + " is outside [-1, " + std::to_string(n) + ")");
  };
  check_special("bos", special.bos);
  check_special("eos", special.eos);
  check_special("unk", special.unk);
  check_special("pad", special.pad);
  t.special = special;

  t.types.resize(tokens.size(), TokenType::kNormal);
  for (std::size_t i = 0; i < token_types.size(); ++i) {
    if (token_types[i] < 0 || token_types[i] > 6)
      fail("from_vocab: token_types[" + std::to_string(i) + "] = " + std::to_string(token_types[i]) + " is outside 0..6");
    t.types[i] = static_cast<TokenType>(token_types[i]);
  }
  t.index.reserve(tokens.size());
  for (std::int32_t i = 0; i < n; ++i) {
    if (tokens[i].empty()) fail("from_vocab: token " + std::to_string(i) + " is empty");
    const auto [it, inserted] = t.index.emplace(tokens[i], i);
    if (!inserted)
      fail("from_vocab: token " + quoted(tokens[i]) + " at id " + std::to_string(i) + " repeats id " + std::to_string(it->second));
  }

  t.merges.reserve(merges.size());
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    const std::size_t sp = m.find(' ');
    if (sp == std::string::npos || sp == 0 || sp + 1 == m.size() || m.find(' ', sp + 1) != std::string::npos)
      fail("from_vocab: merge " + std::to_string(r) + " " + quoted(m) + " is not two non-empty tokens separated by one space");
    const std::string_view left(m.data(), sp), right(m.data() + sp + 1, m.size() - sp - 1);
    const auto l = t.index.find(left), rt = t.index.find(right);
    if (l == t.index.end()) fail("from_vocab: merge " + std::to_string(r) + " " + quoted(m) + " names " + quoted(left) + ", not a token");
    if (rt == t.index.end()) fail("from_vocab: merge " + std::to_string(r) + " " + quoted(m) + " names " + quoted(right) + ", not a token");
    const std::string joined = std::string(left) + std::string(right);
    const auto j = t.index.find(joined);
    if (j == t.index.end()) fail("from_vocab: merge " + std::to_string(r) + " " + quoted(m) + " makes " + quoted(joined) + ", not a token");
    const auto [it, inserted] = t.merges.emplace(pair_key(l->second, rt->second), Impl::Merge{static_cast<std::int32_t>(r), j->second});
    if (!inserted) fail("from_vocab: merge " + std::to_string(r) + " " + quoted(m) + " repeats merge " + std::to_string(it->second.rank));
  }

  const auto b2u = byte_to_code_point();
  t.byte_of.fill(-1);
  for (int b = 0; b < 256; ++b) {
    append_utf8(t.byte_chars[b], b2u[b]);
    const auto it = t.index.find(t.byte_chars[b]);
    t.byte_token[b] = it == t.index.end() ? -1 : it->second;
    t.byte_of[b2u[b]] = static_cast<std::int16_t>(b);
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    const auto f = t.index.find(std::string_view(name));
    t.fallback_token[b] = f == t.index.end() ? -1 : f->second;
  }
  for (std::int32_t i = 0; i < n; ++i) {
    if (t.types[i] == TokenType::kControl || t.types[i] == TokenType::kUserDefined)
      t.specials[static_cast<unsigned char>(tokens[i][0])].push_back({tokens[i], i});
  }
  for (auto& bucket : t.specials)
    std::stable_sort(bucket.begin(), bucket.end(),
                     [](const Impl::Special& a, const Impl::Special& b) { return a.text.size() > b.text.size(); });
  t.tokens = std::move(tokens);
  t.chat_template = std::move(chat_template);
  return BpeTokenizer(std::move(impl));
}

BpeTokenizer BpeTokenizer::from_gguf(const kvpolicy::io::GgufFile& file) {
  auto check = [](const kvpolicy::Status& s) {
    if (!s) fail(std::string("from_gguf: ") + s.message());
  };
  std::string model;
  check(file.get_string("tokenizer.ggml.model", &model));
  if (model != "gpt2") fail("from_gguf: tokenizer.ggml.model is " + quoted(model) + "; only 'gpt2' (byte-level BPE) is supported");
  std::vector<std::string> tokens, merges;
  check(file.get_strings("tokenizer.ggml.tokens", &tokens));
  check(file.get_strings("tokenizer.ggml.merges", &merges));
  std::vector<std::int32_t> types;
  if (file.find("tokenizer.ggml.token_type") != nullptr) {
    std::vector<std::int64_t> raw;
    check(file.get_ints("tokenizer.ggml.token_type", &raw));
    types.reserve(raw.size());
    for (std::size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] < 0 || raw[i] > 6)
        fail("from_gguf: tokenizer.ggml.token_type[" + std::to_string(i) + "] = " + std::to_string(raw[i]) + " is outside 0..6");
      types.push_back(static_cast<std::int32_t>(raw[i]));
    }
  }
  std::string pre = "gpt2";
  if (file.find("tokenizer.ggml.pre") != nullptr) check(file.get_string("tokenizer.ggml.pre", &pre));
  auto id_of = [&](const char* key) -> std::int32_t {
    if (file.find(key) == nullptr) return -1;
    std::uint64_t v = 0;
    check(file.get_uint(key, &v));
    if (v >= tokens.size())
      fail(std::string("from_gguf: ") + key + " = " + std::to_string(v) + " is outside [0, " + std::to_string(tokens.size()) + ")");
    return static_cast<std::int32_t>(v);
  };
  SpecialTokens special{.bos = id_of("tokenizer.ggml.bos_token_id"),
                        .eos = id_of("tokenizer.ggml.eos_token_id"),
                        .unk = id_of("tokenizer.ggml.unknown_token_id"),
                        .pad = id_of("tokenizer.ggml.padding_token_id")};
  std::string tmpl;
  if (file.find("tokenizer.chat_template") != nullptr) check(file.get_string("tokenizer.chat_template", &tmpl));
  return from_vocab(std::move(tokens), merges, std::move(types), std::move(pre), special, std::move(tmpl));
}

std::vector<std::int32_t> BpeTokenizer::encode(std::string_view text, bool parse_special) const {
  const Impl& t = *impl_;
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 3 + 4);
  Impl::Cache cache;
  if (!parse_special) {
    t.encode_plain(text, cache, out);
    return out;
  }
  std::size_t start = 0;  // start of the plain text not yet encoded
  for (std::size_t i = 0; i < text.size();) {
    const auto& bucket = t.specials[static_cast<unsigned char>(text[i])];
    const Impl::Special* hit = nullptr;
    for (const auto& s : bucket) {
      if (text.compare(i, s.text.size(), s.text) == 0) {
        hit = &s;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    if (i > start) t.encode_plain(text.substr(start, i - start), cache, out);
    out.push_back(hit->id);
    i += hit->text.size();
    start = i;
  }
  if (start < text.size()) t.encode_plain(text.substr(start), cache, out);
  return out;
}

std::vector<std::string_view> BpeTokenizer::split(std::string_view text) const {
  std::vector<std::string_view> out;
  impl_->pre_tokenize(text, [&](std::string_view piece) { out.push_back(piece); });
  return out;
}

std::string BpeTokenizer::decode(std::span<const std::int32_t> ids) const {
  const Impl& t = *impl_;
  std::string out, mapped;
  auto flush = [&] {
    for (std::size_t i = 0; i < mapped.size();) {
      std::uint32_t cp;
      const std::size_t len = utf8_next(mapped, i, &cp);
      if (cp < kMaxMappedCodePoint && t.byte_of[cp] >= 0)
        out += static_cast<char>(t.byte_of[cp]);
      else
        out.append(mapped, i, len);  // not a byte-level character: kept as it is
      i += len;
    }
    mapped.clear();
  };
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const std::int32_t id = ids[k];
    if (id < 0 || id >= vocab_size())
      fail("decode: ids[" + std::to_string(k) + "] = " + std::to_string(id) + " is outside [0, " + std::to_string(vocab_size()) + ")");
    const TokenType type = t.types[id];
    if (type == TokenType::kControl || type == TokenType::kUserDefined) {
      flush();
      out += t.tokens[id];
      continue;
    }
    const std::string& s = t.tokens[id];
    if (const int b = fallback_byte(s); b >= 0 && t.fallback_token[b] == id) {
      mapped += static_cast<char>(b);
      continue;
    }
    mapped += s;
  }
  flush();
  return out;
}

const std::string& BpeTokenizer::token(std::int32_t id) const {
  if (id < 0 || id >= vocab_size()) fail("token: id " + std::to_string(id) + " is outside [0, " + std::to_string(vocab_size()) + ")");
  return impl_->tokens[id];
}

std::int32_t BpeTokenizer::id(std::string_view text) const {
  const auto it = impl_->index.find(text);
  return it == impl_->index.end() ? -1 : it->second;
}

TokenType BpeTokenizer::token_type(std::int32_t id) const {
  if (id < 0 || id >= vocab_size()) fail("token_type: id " + std::to_string(id) + " is outside [0, " + std::to_string(vocab_size()) + ")");
  return impl_->types[id];
}

std::int32_t BpeTokenizer::vocab_size() const noexcept { return static_cast<std::int32_t>(impl_->tokens.size()); }
const SpecialTokens& BpeTokenizer::special_tokens() const noexcept { return impl_->special; }
PreTokenizer BpeTokenizer::pre_tokenizer() const noexcept { return impl_->pre; }
const std::string& BpeTokenizer::chat_template() const noexcept { return impl_->chat_template; }
const char* BpeTokenizer::unicode_version() noexcept { return kUnicodeVersion; }

std::string BpeTokenizer::apply_chat_template(const std::vector<ChatMessage>& msgs, bool add_generation_prompt) const {
  if (impl_->chat_template != kSmolLM2ChatTemplate)
    fail(impl_->chat_template.empty() ? std::string("apply_chat_template: the tokenizer has no chat template")
                                      : "apply_chat_template: the chat template (" + std::to_string(impl_->chat_template.size()) +
                                            " bytes) is not SmolLM2's ChatML template, the only one implemented");
  std::string out;
  if (!msgs.empty() && msgs.front().role != "system") out += kSmolLM2DefaultSystem;
  for (const auto& m : msgs) {
    out += "<|im_start|>";
    out += m.role;
    out += '\n';
    out += m.content;
    out += "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace kvp_engine
