// GGUF reader: images built in memory by a small writer check every value
// type, v2/v3, alignment and the tensor table; a battery of corrupt images
// must each raise loom::Error naming the problem, never crash.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/gguf.h"

namespace loom::gguf {
namespace {

// ---- a tiny GGUF writer ---------------------------------------------------

struct Enc {  // one encoded metadata value
  ValueType type;
  std::vector<uint8_t> bytes;
};

template <typename T>
void put(std::vector<uint8_t>& b, T v) {
  const size_t at = b.size();
  b.resize(at + sizeof(T));
  std::memcpy(b.data() + at, &v, sizeof(T));
}
void put_str(std::vector<uint8_t>& b, std::string_view s) {
  put<uint64_t>(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}

template <typename T>
Enc scalar(ValueType t, T v) {
  Enc e{t, {}};
  put(e.bytes, v);
  return e;
}
Enc str(std::string_view s) {
  Enc e{ValueType::string, {}};
  put_str(e.bytes, s);
  return e;
}
Enc arr(ValueType elem, const std::vector<Enc>& items) {
  Enc e{ValueType::array, {}};
  put<uint32_t>(e.bytes, static_cast<uint32_t>(elem));
  put<uint64_t>(e.bytes, items.size());
  for (const auto& it : items) e.bytes.insert(e.bytes.end(), it.bytes.begin(), it.bytes.end());
  return e;
}

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> ne;  // GGUF order, innermost first
  uint32_t type = 0;
  std::vector<uint8_t> data;
  std::optional<uint64_t> offset;  // default: packed and aligned
};

// Byte positions of fields in the built image, for corrupting them.
struct Layout {
  size_t version = 4, tensor_count = 8, kv_count = 16;
  std::vector<size_t> kv_key, kv_type, kv_value;
  std::vector<size_t> t_name, t_ndims, t_dims, t_type, t_offset;
  size_t data_start = 0;
};

struct Builder {
  uint32_t version = 3;
  size_t alignment = 32;  // layout only; add a general.alignment kv to change the file's
  std::vector<std::pair<std::string, Enc>> kvs;
  std::vector<TensorSpec> tensors;

  Builder& kv(std::string key, Enc v) {
    kvs.emplace_back(std::move(key), std::move(v));
    return *this;
  }
  Builder& tensor(std::string name, std::vector<uint64_t> ne, uint32_t type, std::vector<uint8_t> data) {
    tensors.push_back({std::move(name), std::move(ne), type, std::move(data), std::nullopt});
    return *this;
  }

  std::vector<uint8_t> build(Layout* layout = nullptr) const {
    Layout L;
    std::vector<uint8_t> b;
    put<uint32_t>(b, 0x46554747);
    put<uint32_t>(b, version);
    put<uint64_t>(b, tensors.size());
    put<uint64_t>(b, kvs.size());
    for (const auto& [k, v] : kvs) {
      L.kv_key.push_back(b.size());
      put_str(b, k);
      L.kv_type.push_back(b.size());
      put<uint32_t>(b, static_cast<uint32_t>(v.type));
      L.kv_value.push_back(b.size());
      b.insert(b.end(), v.bytes.begin(), v.bytes.end());
    }
    std::vector<uint64_t> offsets;
    uint64_t next = 0;
    for (const auto& t : tensors) {
      offsets.push_back(t.offset ? *t.offset : next);
      next = (next + t.data.size() + alignment - 1) / alignment * alignment;
      L.t_name.push_back(b.size());
      put_str(b, t.name);
      L.t_ndims.push_back(b.size());
      put<uint32_t>(b, static_cast<uint32_t>(t.ne.size()));
      L.t_dims.push_back(b.size());
      for (uint64_t d : t.ne) put<uint64_t>(b, d);
      L.t_type.push_back(b.size());
      put<uint32_t>(b, t.type);
      L.t_offset.push_back(b.size());
      put<uint64_t>(b, offsets.back());
    }
    if (!tensors.empty()) {
      b.resize((b.size() + alignment - 1) / alignment * alignment, 0);
      L.data_start = b.size();
      for (size_t i = 0; i < tensors.size(); ++i) {
        if (tensors[i].offset) continue;  // deliberately placed elsewhere: no data written
        b.resize(std::max(b.size(), L.data_start + offsets[i] + tensors[i].data.size()), 0);
        std::memcpy(b.data() + L.data_start + offsets[i], tensors[i].data.data(), tensors[i].data.size());
      }
    }
    if (layout) *layout = L;
    return b;
  }
};

template <typename T>
void patch(std::vector<uint8_t>& b, size_t pos, T v) {
  ASSERT_LE(pos + sizeof(T), b.size());
  std::memcpy(b.data() + pos, &v, sizeof(T));
}

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start = 1) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(start + i);
  return v;
}

// f32 [2, 3] and q8_0 [2, 32] plus a little metadata.
Builder small_model() {
  Builder b;
  b.kv("general.architecture", str("llama"))
      .kv("llama.block_count", scalar<uint32_t>(ValueType::u32, 2))
      .kv("tokenizer.ggml.tokens", arr(ValueType::string, {str("a"), str("bc")}))
      .tensor("w.f32", {3, 2}, 0, iota_bytes(24))
      .tensor("w.q8", {32, 2}, 8, iota_bytes(68, 100));
  return b;
}

// Parses a heap copy of the first `len` bytes (exactly sized, so that ASan
// catches any read past the end) and reads every tensor byte.
void parse_exact(const std::vector<uint8_t>& img, size_t len) {
  std::unique_ptr<uint8_t[]> copy(new uint8_t[len == 0 ? 1 : len]);
  if (len) std::memcpy(copy.get(), img.data(), len);
  auto f = File::parse(copy.get(), len, "test.gguf");
  // Touch every tensor byte while the copy is alive.
  unsigned acc = 0;
  for (const auto& t : f->tensors())
    for (size_t i = 0; i < t.nbytes; ++i) acc += t.data[i];
  (void)acc;
}

// Expects an Error of `kind` whose message names the file and contains every
// fragment.
void expect_error(const std::vector<uint8_t>& img, ErrorKind kind, std::vector<std::string> fragments) {
  try {
    parse_exact(img, img.size());
    ADD_FAILURE() << "parsed without error; expected: " << fragments[0];
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.kind(), kind) << msg;
    EXPECT_EQ(msg.rfind("test.gguf: ", 0), 0u) << msg;
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

// ---- valid files ----------------------------------------------------------

class GgufVersion : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufVersion, AllValueTypesRoundTrip) {
  Builder b;
  b.version = GetParam();
  b.kv("u8", scalar<uint8_t>(ValueType::u8, 255))
      .kv("i8", scalar<int8_t>(ValueType::i8, -128))
      .kv("u16", scalar<uint16_t>(ValueType::u16, 65535))
      .kv("i16", scalar<int16_t>(ValueType::i16, -32768))
      .kv("u32", scalar<uint32_t>(ValueType::u32, 4000000000u))
      .kv("i32", scalar<int32_t>(ValueType::i32, -7))
      .kv("f32", scalar<float>(ValueType::f32, 1e-5f))
      .kv("bool.t", scalar<uint8_t>(ValueType::boolean, 1))
      .kv("bool.f", scalar<uint8_t>(ValueType::boolean, 0))
      .kv("str", str(std::string("h\xc3\xa9llo\0x", 8)))
      .kv("empty", str(""))
      .kv("u64", scalar<uint64_t>(ValueType::u64, std::numeric_limits<uint64_t>::max()))
      .kv("i64", scalar<int64_t>(ValueType::i64, std::numeric_limits<int64_t>::min()))
      .kv("f64", scalar<double>(ValueType::f64, 0.1))
      .kv("a.str", arr(ValueType::string, {str("x"), str(""), str("yz")}))
      .kv("a.f32", arr(ValueType::f32, {scalar<float>(ValueType::f32, 0.5f), scalar<float>(ValueType::f32, -1e30f)}))
      .kv("a.i32", arr(ValueType::i32, {scalar<int32_t>(ValueType::i32, -1), scalar<int32_t>(ValueType::i32, 1 << 30)}))
      .kv("a.u32.big", arr(ValueType::u32, {scalar<uint32_t>(ValueType::u32, 3000000000u)}))
      .kv("a.u8", arr(ValueType::u8, {scalar<uint8_t>(ValueType::u8, 7)}))
      .kv("a.empty", arr(ValueType::i64, {}))
      .kv("a.nested", arr(ValueType::array, {arr(ValueType::i16, {scalar<int16_t>(ValueType::i16, -3)}),
                                             arr(ValueType::string, {str("deep")})}))
      .kv("a.bool", arr(ValueType::boolean, {scalar<uint8_t>(ValueType::boolean, 1)}));
  const auto img = b.build();
  auto f = File::parse(img.data(), img.size(), "test.gguf");
  EXPECT_EQ(f->version(), GetParam());
  EXPECT_EQ(f->metadata().size(), 22u);
  EXPECT_TRUE(f->tensors().empty());

  EXPECT_EQ(f->get_uint("u8"), 255u);
  EXPECT_EQ(f->get_int("i8"), -128);
  EXPECT_EQ(f->get_uint("u16"), 65535u);
  EXPECT_EQ(f->get_int("i16"), -32768);
  EXPECT_EQ(f->get_uint("u32"), 4000000000u);
  EXPECT_EQ(f->get_int("u32"), 4000000000);
  EXPECT_EQ(f->get_int("i32"), -7);
  EXPECT_EQ(f->get_float("f32"), static_cast<double>(1e-5f));
  EXPECT_EQ(f->get_float("i32"), -7.0);  // integers are accepted as numbers
  EXPECT_TRUE(f->get_bool("bool.t"));
  EXPECT_FALSE(f->get_bool("bool.f"));
  EXPECT_EQ(f->get_string("str"), std::string("h\xc3\xa9llo\0x", 8));
  EXPECT_EQ(f->get_string("empty"), "");
  EXPECT_EQ(f->get_uint("u64"), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(f->get_int("i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(f->get_float("f64"), 0.1);
  EXPECT_EQ(f->get_string_array("a.str"), (std::vector<std::string>{"x", "", "yz"}));
  EXPECT_EQ(f->get_f32_array("a.f32"), (std::vector<float>{0.5f, -1e30f}));
  EXPECT_EQ(f->get_f32_array("a.i32"), (std::vector<float>{-1.0f, 1073741824.0f}));
  EXPECT_EQ(f->get_i32_array("a.i32"), (std::vector<int32_t>{-1, 1 << 30}));
  EXPECT_EQ(f->get_i32_array("a.u8"), (std::vector<int32_t>{7}));
  EXPECT_TRUE(f->get_i32_array("a.empty").empty());

  const Value* nested = f->find("a.nested");
  ASSERT_NE(nested, nullptr);
  ASSERT_EQ(nested->type, ValueType::array);
  const auto& outer = std::get<Array>(nested->v);
  EXPECT_EQ(outer.element_type, ValueType::array);
  ASSERT_EQ(outer.items.size(), 2u);
  const auto& inner0 = std::get<Array>(outer.items[0].v);
  EXPECT_EQ(inner0.element_type, ValueType::i16);
  EXPECT_EQ(std::get<int64_t>(inner0.items.at(0).v), -3);
  EXPECT_EQ(std::get<std::string>(std::get<Array>(outer.items[1].v).items.at(0).v), "deep");
  EXPECT_EQ(std::get<bool>(std::get<Array>(f->find("a.bool")->v).items.at(0).v), true);

  // Optional getters and type errors.
  EXPECT_EQ(f->opt_uint("nope"), std::nullopt);
  EXPECT_EQ(f->opt_string("nope"), std::nullopt);
  EXPECT_EQ(f->opt_float("nope"), std::nullopt);
  EXPECT_EQ(f->opt_bool("nope"), std::nullopt);
  EXPECT_EQ(f->opt_uint("u16"), 65535u);
  EXPECT_EQ(f->opt_bool("bool.t"), true);
  EXPECT_EQ(f->find("nope"), nullptr);
  auto expect_getter_error = [](auto fn, const std::vector<std::string>& fragments) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected " << fragments[0];
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::invalid_input);
      for (const auto& s : fragments) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
    }
  };
  expect_getter_error([&] { f->get_string("missing.key"); }, {"test.gguf", "'missing.key'", "missing"});
  expect_getter_error([&] { f->get_string("u8"); }, {"'u8'", "expected string, got u8"});
  expect_getter_error([&] { f->get_uint("i8"); }, {"'i8'", "non-negative", "-128"});
  expect_getter_error([&] { f->get_int("u64"); }, {"'u64'", "does not fit"});
  expect_getter_error([&] { f->get_bool("u8"); }, {"expected bool"});
  expect_getter_error([&] { f->get_float("str"); }, {"expected a number, got string"});
  expect_getter_error([&] { f->opt_uint("str"); }, {"'str'"});
  expect_getter_error([&] { f->get_string_array("a.i32"); }, {"'a.i32'", "got array of i32"});
  expect_getter_error([&] { f->get_string_array("str"); }, {"got string"});
  expect_getter_error([&] { f->get_f32_array("a.str"); }, {"array of numbers"});
  expect_getter_error([&] { f->get_i32_array("a.u32.big"); }, {"element 0 = 3000000000 does not fit in int32"});
  expect_getter_error([&] { f->get_i32_array("a.f32"); }, {"array of integers"});
}

TEST_P(GgufVersion, TensorTable) {
  Builder b = small_model();
  b.version = GetParam();
  b.tensor("w.f16", {5}, 1, iota_bytes(10, 7)).tensor("w.q4_1.3d", {64, 3, 2}, 3, iota_bytes(2 * 20 * 6, 3));
  Layout L;
  const auto img = b.build(&L);
  auto f = File::parse(img.data(), img.size(), "test.gguf");
  ASSERT_EQ(f->tensors().size(), 4u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->data_offset(), L.data_start);
  EXPECT_EQ(f->data_offset() % 32, 0u);
  EXPECT_EQ(f->get_string("general.architecture"), "llama");

  const TensorInfo* w = f->find_tensor("w.f32");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, DType::f32);
  EXPECT_EQ(w->ndim, 2);
  EXPECT_EQ(w->shape[0], 2);  // outermost first
  EXPECT_EQ(w->shape[1], 3);
  EXPECT_EQ(w->nbytes, 24u);
  EXPECT_EQ(w->offset, L.data_start);
  EXPECT_EQ(w->data, img.data() + L.data_start);
  EXPECT_EQ(w->data[0], 1);

  const TensorInfo* q = f->find_tensor("w.q8");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->dtype, DType::q8_0);
  EXPECT_EQ(q->nbytes, 68u);
  EXPECT_EQ(q->offset, L.data_start + 32);
  EXPECT_EQ(q->data[0], 100);
  const Tensor v = q->view();
  EXPECT_EQ(v.numel(), 64);
  EXPECT_EQ(v.rows(), 2);
  EXPECT_EQ(v.cols(), 32);
  EXPECT_EQ(v.nbytes(), q->nbytes);
  EXPECT_EQ(v.row_ptr(1), q->data + 34);

  const TensorInfo* t3 = f->find_tensor("w.q4_1.3d");
  ASSERT_NE(t3, nullptr);
  EXPECT_EQ(t3->ndim, 3);
  EXPECT_EQ(t3->shape[0], 2);
  EXPECT_EQ(t3->shape[1], 3);
  EXPECT_EQ(t3->shape[2], 64);
  EXPECT_EQ(t3->nbytes, 240u);
  EXPECT_EQ(t3->view().nbytes(), 240u);
  EXPECT_EQ(t3->offset % 32, 0u);
  EXPECT_EQ(f->find_tensor("w.f16")->shape[0], 5);
  EXPECT_EQ(f->find_tensor("missing"), nullptr);
  EXPECT_EQ(f->tensors()[0].name, "w.f32");  // file order kept
  EXPECT_EQ(f->tensors()[3].name, "w.q4_1.3d");
}

INSTANTIATE_TEST_SUITE_P(V2AndV3, GgufVersion, ::testing::Values(2u, 3u));

TEST(Gguf, CustomAlignmentIsHonoured) {
  for (uint32_t a : {1u, 8u, 64u, 256u}) {
    Builder b = small_model();
    b.alignment = a;
    b.kv("general.alignment", scalar<uint32_t>(ValueType::u32, a));
    Layout L;
    const auto img = b.build(&L);
    auto f = File::parse(img.data(), img.size(), "test.gguf");
    EXPECT_EQ(f->alignment(), a);
    EXPECT_EQ(f->data_offset(), L.data_start) << a;
    const size_t second = (24 + a - 1) / a * a;  // w.f32 holds 24 bytes
    EXPECT_EQ(f->find_tensor("w.q8")->offset, L.data_start + second) << a;
    EXPECT_EQ(L.data_start % a, 0u);
    EXPECT_EQ(f->find_tensor("w.q8")->data[0], 100) << a;
  }
}

TEST(Gguf, EmptyFileWithoutTensorsNeedsNoPadding) {
  Builder b;
  b.kv("k", scalar<uint8_t>(ValueType::u8, 1));
  const auto img = b.build();
  auto f = File::parse(img.data(), img.size(), "test.gguf");
  EXPECT_EQ(f->get_uint("k"), 1u);
  EXPECT_TRUE(f->tensors().empty());
}

TEST(Gguf, NestingUpToTheLimit) {
  auto nested = [](int depth) {
    Enc e = arr(ValueType::u8, {scalar<uint8_t>(ValueType::u8, 9)});
    for (int d = 1; d < depth; ++d) e = arr(ValueType::array, {e});
    return e;
  };
  Builder ok;
  ok.kv("deep", nested(kMaxArrayDepth));
  const auto img = ok.build();
  EXPECT_NO_THROW(File::parse(img.data(), img.size(), "test.gguf"));
  Builder bad;
  bad.kv("deeper", nested(kMaxArrayDepth + 1));
  expect_error(bad.build(), ErrorKind::invalid_input, {"key 'deeper'", "nested more than 8 deep"});
}

// ---- corrupt files --------------------------------------------------------

TEST(GgufCorrupt, TruncatedAtEveryByte) {
  const auto img = small_model().build();
  for (size_t len = 0; len < img.size(); ++len) {
    try {
      parse_exact(img, len);
      ADD_FAILURE() << "prefix of " << len << " bytes parsed";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.kind(), ErrorKind::invalid_input) << msg;
      EXPECT_EQ(msg.rfind("test.gguf: ", 0), 0u) << msg;
      const bool named = msg.find("truncated") != std::string::npos || msg.find("too small") != std::string::npos ||
                         msg.find("exceeds the") != std::string::npos ||
                         msg.find("past the end") != std::string::npos ||
                         msg.find("impossible") != std::string::npos || msg.find("bytes are left") != std::string::npos;
      EXPECT_TRUE(named) << len << ": " << msg;
    }
  }
}

TEST(GgufCorrupt, HeaderProblems) {
  auto img = small_model().build();
  auto bad = img;
  bad[0] = 'X';
  expect_error(bad, ErrorKind::invalid_input, {"not a GGUF file", "'XGUF'"});
  bad = img;
  patch<uint32_t>(bad, 4, 1);
  expect_error(bad, ErrorKind::unsupported, {"version 1 is not supported"});
  patch<uint32_t>(bad, 4, 4);
  expect_error(bad, ErrorKind::unsupported, {"version 4 is not supported"});
  patch<uint32_t>(bad, 4, 0x03000000);
  expect_error(bad, ErrorKind::unsupported, {"big-endian"});
  expect_error({}, ErrorKind::invalid_input, {"too small"});
}

TEST(GgufCorrupt, HugeCounts) {
  Layout L;
  auto img = small_model().build(&L);
  auto bad = img;
  patch<uint64_t>(bad, L.kv_count, std::numeric_limits<uint64_t>::max());
  expect_error(bad, ErrorKind::invalid_input, {"metadata count 18446744073709551615 is impossible"});
  bad = img;
  patch<uint64_t>(bad, L.tensor_count, uint64_t{1} << 62);
  expect_error(bad, ErrorKind::invalid_input, {"tensor count 4611686018427387904 is impossible"});
  bad = img;
  patch<uint64_t>(bad, L.tensor_count, 3);  // one more than there are
  expect_error(bad, ErrorKind::invalid_input, {"tensor #2"});
}

TEST(GgufCorrupt, HugeStringLengths) {
  Layout L;
  auto img = small_model().build(&L);
  auto bad = img;
  patch<uint64_t>(bad, L.kv_key[1], std::numeric_limits<uint64_t>::max());
  expect_error(bad, ErrorKind::invalid_input, {"metadata entry #1", "key length 18446744073709551615 exceeds"});
  bad = img;
  patch<uint64_t>(bad, L.kv_value[0], uint64_t{1} << 40);  // general.architecture's string
  expect_error(bad, ErrorKind::invalid_input, {"key 'general.architecture'", "string length 1099511627776 exceeds"});
  bad = img;
  patch<uint64_t>(bad, L.t_name[1], 1000);
  expect_error(bad, ErrorKind::invalid_input, {"tensor #1", "tensor name length 1000 exceeds"});
  bad = img;
  // the second string inside tokenizer.ggml.tokens: type(4) + count(8) + "a"(8 + 1)
  patch<uint64_t>(bad, L.kv_value[2] + 4 + 8 + 9, uint64_t{1} << 63);
  expect_error(bad, ErrorKind::invalid_input, {"key 'tokenizer.ggml.tokens'", "string length"});
}

TEST(GgufCorrupt, BadValueTypes) {
  Layout L;
  auto img = small_model().build(&L);
  auto bad = img;
  patch<uint32_t>(bad, L.kv_type[1], 13);
  expect_error(bad, ErrorKind::invalid_input, {"key 'llama.block_count'", "unknown value type 13"});
  patch<uint32_t>(bad, L.kv_type[1], 0xffffffffu);
  expect_error(bad, ErrorKind::invalid_input, {"unknown value type 4294967295"});
  bad = img;
  patch<uint32_t>(bad, L.kv_value[2], 99);  // array element type
  expect_error(bad, ErrorKind::invalid_input, {"key 'tokenizer.ggml.tokens'", "unknown array element type 99"});
  Builder b;
  b.kv("flag", scalar<uint8_t>(ValueType::boolean, 2));
  expect_error(b.build(), ErrorKind::invalid_input, {"key 'flag'", "bool value 2"});
}

TEST(GgufCorrupt, HugeArrayLengths) {
  // u64 elements: 2^61 * 8 wraps to 0 in 64 bits, so a multiply-then-compare check would pass.
  Builder b;
  b.kv("a", arr(ValueType::u64, {scalar<uint64_t>(ValueType::u64, 1)}));
  Layout L;
  auto img = b.build(&L);
  patch<uint64_t>(img, L.kv_value[0] + 4, uint64_t{1} << 61);
  expect_error(img, ErrorKind::invalid_input, {"key 'a'", "array of 2305843009213693952 u64 elements"});
  patch<uint64_t>(img, L.kv_value[0] + 4, std::numeric_limits<uint64_t>::max());
  expect_error(img, ErrorKind::invalid_input, {"array of 18446744073709551615"});
  Builder n;
  n.kv("nest", arr(ValueType::array, {arr(ValueType::u8, {})}));
  img = n.build(&L);
  patch<uint64_t>(img, L.kv_value[0] + 4, uint64_t{1} << 60);
  expect_error(img, ErrorKind::invalid_input, {"array of 1152921504606846976 array elements"});
}

TEST(GgufCorrupt, DuplicatesAndEmptyNames) {
  Builder b = small_model();
  b.kv("llama.block_count", scalar<uint32_t>(ValueType::u32, 3));
  expect_error(b.build(), ErrorKind::invalid_input, {"key 'llama.block_count'", "duplicate key"});
  b = small_model();
  b.tensor("w.f32", {1}, 0, iota_bytes(4));
  expect_error(b.build(), ErrorKind::invalid_input, {"tensor 'w.f32'", "duplicate tensor name"});
  b = small_model();
  b.kv("", scalar<uint8_t>(ValueType::u8, 0));
  expect_error(b.build(), ErrorKind::invalid_input, {"metadata entry #3", "empty key"});
  b = small_model();
  b.tensor("", {1}, 0, iota_bytes(4));
  expect_error(b.build(), ErrorKind::invalid_input, {"tensor #2", "empty tensor name"});
}

TEST(GgufCorrupt, BadDimensions) {
  Layout L;
  const auto img = small_model().build(&L);
  auto bad = img;
  patch<uint32_t>(bad, L.t_ndims[0], 0);
  expect_error(bad, ErrorKind::invalid_input, {"tensor 'w.f32'", "n_dims 0 is outside 1..4"});
  patch<uint32_t>(bad, L.t_ndims[0], 5);
  expect_error(bad, ErrorKind::invalid_input, {"n_dims 5"});
  patch<uint32_t>(bad, L.t_ndims[0], 0xffffffffu);
  expect_error(bad, ErrorKind::invalid_input, {"n_dims 4294967295"});
  bad = img;
  patch<uint64_t>(bad, L.t_dims[0] + 8, 0);
  expect_error(bad, ErrorKind::invalid_input, {"tensor 'w.f32'", "dimension 1 is 0"});
  patch<uint64_t>(bad, L.t_dims[0] + 8, uint64_t{1} << 63);
  expect_error(bad, ErrorKind::invalid_input, {"dimension 1 = 9223372036854775808 is too large"});

  Builder b;
  b.tensor("big", {uint64_t{1} << 32, uint64_t{1} << 32, 2}, 0, {});
  b.tensors.back().offset = 0;
  expect_error(b.build(), ErrorKind::invalid_input, {"tensor 'big'", "element count overflows"});
  b.tensors.back().ne = {uint64_t{1} << 62, 1};  // numel fits, bytes (x4) do not
  expect_error(b.build(), ErrorKind::invalid_input, {"tensor 'big'", "byte size overflows"});
  b.tensors.back().ne = {uint64_t{1} << 40, 1 << 20};  // fits in 64 bits, not in the file
  expect_error(b.build(), ErrorKind::invalid_input, {"tensor 'big'", "past the end of the file"});
}

TEST(GgufCorrupt, BlockSizeMismatch) {
  Builder b;
  b.tensor("q", {48, 2}, 2, iota_bytes(64));  // q4_0 rows must be multiples of 32
  expect_error(b.build(), ErrorKind::invalid_input, {"tensor 'q'", "row length 48", "q4_0 block size 32"});
  Builder k;
  k.tensor("k", {32}, 12, iota_bytes(144));  // q4_k needs 256
  expect_error(k.build(), ErrorKind::invalid_input, {"row length 32", "q4_k block size 256"});
}

TEST(GgufCorrupt, UnknownTensorTypes) {
  Layout L;
  const auto img = small_model().build(&L);
  auto bad = img;
  patch<uint32_t>(bad, L.t_type[1], 36);
  expect_error(bad, ErrorKind::unsupported,
               {"tensor 'w.q8'", "tensor type 36 (iq4_nl repack (removed from ggml)) is not supported"});
  patch<uint32_t>(bad, L.t_type[1], 999);
  expect_error(bad, ErrorKind::unsupported, {"tensor 'w.q8'", "tensor type 999 (unknown)"});
  patch<uint32_t>(bad, L.t_type[1], 4);
  expect_error(bad, ErrorKind::unsupported, {"tensor type 4"});
}

TEST(GgufCorrupt, OffsetsOutOfRangeOrMisaligned) {
  Layout L;
  const auto img = small_model().build(&L);
  auto bad = img;
  patch<uint64_t>(bad, L.t_offset[1], 4);
  expect_error(bad, ErrorKind::invalid_input, {"tensor 'w.q8'", "offset 4 is not a multiple of the alignment 32"});
  patch<uint64_t>(bad, L.t_offset[1], uint64_t{1} << 40);
  expect_error(bad, ErrorKind::invalid_input, {"tensor 'w.q8'", "past the end of the file"});
  // offset + nbytes wraps around 2^64
  patch<uint64_t>(bad, L.t_offset[1], std::numeric_limits<uint64_t>::max() - 31);
  expect_error(bad, ErrorKind::invalid_input, {"tensor 'w.q8'", "past the end of the file"});
  patch<uint64_t>(bad, L.t_offset[1], 64);  // 64 + 68 > 100 bytes of data
  expect_error(bad, ErrorKind::invalid_input, {"tensor 'w.q8'", "past the end"});
  // The file ends right after the tensor infos: no data section at all.
  bad = img;
  bad.resize(L.t_offset.back() + 8);
  expect_error(bad, ErrorKind::invalid_input, {"past the end"});
}

TEST(GgufCorrupt, BadAlignment) {
  for (uint32_t a : {0u, 3u, 48u, 0x80000000u}) {
    Builder b = small_model();
    b.kv("general.alignment", scalar<uint32_t>(ValueType::u32, a));
    expect_error(b.build(), ErrorKind::invalid_input, {"key 'general.alignment'", "not a power of two"});
  }
  Builder b = small_model();
  b.kv("general.alignment", str("32"));
  expect_error(b.build(), ErrorKind::invalid_input, {"key 'general.alignment'", "unsigned integer, not string"});
  Builder i = small_model();
  i.kv("general.alignment", scalar<int32_t>(ValueType::i32, 32));
  expect_error(i.build(), ErrorKind::invalid_input, {"not i32"});
}

TEST(GgufCorrupt, UntrustedNamesAreEscapedInMessages) {
  Builder b = small_model();
  b.kv(std::string("bad\n\x01key") + std::string(200, 'x'), scalar<uint8_t>(ValueType::u8, 0));
  b.kv(std::string("bad\n\x01key") + std::string(200, 'x'), scalar<uint8_t>(ValueType::u8, 0));
  expect_error(b.build(), ErrorKind::invalid_input, {"'bad\\x0a\\x01key", "...' (208 bytes)", "duplicate key"});
}

// Random byte flips of a valid file: either it parses (and every tensor byte
// is readable) or it raises loom::Error; anything else fails the test.
TEST(GgufCorrupt, RandomMutationsNeverCrash) {
  Builder b = small_model();
  b.kv("general.alignment", scalar<uint32_t>(ValueType::u32, 16));
  b.alignment = 16;
  b.kv("a.nested", arr(ValueType::array, {arr(ValueType::f32, {scalar<float>(ValueType::f32, 1.0f)})}));
  const auto img = b.build();
  std::mt19937 rng(12345);
  int parsed = 0, errors = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    auto m = img;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t pos = rng() % m.size();
      switch (rng() % 3) {
        case 0: m[pos] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 1: m[pos] = static_cast<uint8_t>(rng()); break;
        default: m[pos] = (rng() & 1) ? 0xff : 0x00; break;
      }
    }
    if (rng() % 8 == 0) m.resize(rng() % m.size());
    try {
      parse_exact(m, m.size());
      ++parsed;
    } catch (const Error& e) {
      ++errors;
      ASSERT_EQ(std::string(e.what()).rfind("test.gguf: ", 0), 0u) << e.what();
    }
  }
  EXPECT_GT(parsed, 0);
  EXPECT_GT(errors, 0);
}

TEST(Gguf, OpenMissingFileIsNotFound) {
  try {
    File::open("/nonexistent/dir/model.gguf");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::not_found);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/model.gguf"), std::string::npos);
  }
}

// ---- the real model -------------------------------------------------------

TEST(GgufModel, SmolLM2) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not present (fetch the default model to run this)";
  auto f = File::open(path);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->tensors().size(), 272u);
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->get_uint("llama.block_count"), 30u);
  EXPECT_EQ(f->get_uint("llama.embedding_length"), 576u);
  EXPECT_EQ(f->get_uint("llama.attention.head_count_kv"), 3u);
  EXPECT_FLOAT_EQ(static_cast<float>(f->get_float("llama.attention.layer_norm_rms_epsilon")), 1e-5f);
  EXPECT_EQ(f->get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_FALSE(f->get_bool("tokenizer.ggml.add_bos_token"));
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(f->get_i32_array("tokenizer.ggml.token_type").size(), 49152u);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.merges").size(), 48900u);

  const TensorInfo* emb = f->find_tensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->dtype, DType::q8_0);
  EXPECT_EQ(emb->shape[0], 49152);
  EXPECT_EQ(emb->shape[1], 576);
  const TensorInfo* down = f->find_tensor("blk.0.ffn_down.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->dtype, DType::q4_1);
  EXPECT_EQ(down->shape[0], 576);  // out features
  EXPECT_EQ(down->shape[1], 1536);
  int q41 = 0, f32 = 0;
  for (const auto& t : f->tensors()) {
    q41 += t.dtype == DType::q4_1;
    f32 += t.dtype == DType::f32;
    EXPECT_EQ(t.offset % f->alignment(), 0u) << t.name;
  }
  EXPECT_EQ(q41, 210);
  EXPECT_EQ(f32, 61);
}

}  // namespace
}  // namespace loom::gguf

namespace loom::gguf {
namespace {

// Files written by gguf-py's GGUFWriter (the fuzz seed corpus, made by
// scripts/fixtures/make_gguf_fuzz_seeds.py): an independent writer.
std::string seed(const char* name) { return std::string(LOOM_SOURCE_DIR) + "/fuzz/corpus/gguf/" + name; }

TEST(GgufInterop, ReadsGgufPyValues) {
  auto f = File::open(seed("values.gguf"));
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->get_uint("v.u8"), 200u);
  EXPECT_EQ(f->get_int("v.i8"), -5);
  EXPECT_EQ(f->get_uint("v.u16"), 60000u);
  EXPECT_EQ(f->get_int("v.i16"), -300);
  EXPECT_EQ(f->get_uint("v.u32"), 7u);
  EXPECT_EQ(f->get_int("v.i32"), -7);
  EXPECT_EQ(f->get_float("v.f32"), 0.5);
  EXPECT_EQ(f->get_uint("v.u64"), uint64_t{1} << 40);
  EXPECT_EQ(f->get_int("v.i64"), -(int64_t{1} << 40));
  EXPECT_EQ(f->get_float("v.f64"), 2.25);
  EXPECT_TRUE(f->get_bool("v.bool"));
  EXPECT_EQ(f->get_string("v.str"), "hello");
  EXPECT_EQ(f->get_string_array("v.tokens"), (std::vector<std::string>{"a", "b", "<s>"}));
  EXPECT_EQ(f->get_f32_array("v.scores"), (std::vector<float>{0.0f, -1.5f, 2.0f}));
  EXPECT_EQ(f->get_i32_array("v.types"), (std::vector<int32_t>{1, 2, 3}));
}

TEST(GgufInterop, ReadsGgufPyTensors) {
  auto f = File::open(seed("tensors.gguf"));
  ASSERT_EQ(f->tensors().size(), 12u);
  const TensorInfo* t = f->find_tensor("t.f32");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape[0], 2);
  EXPECT_EQ(t->shape[1], 3);
  float v[6];
  std::memcpy(v, t->data, sizeof(v));
  EXPECT_EQ(v[5], 5.0f);
  const struct { const char* name; DType type; int64_t rows, cols; } want[] = {
      {"t.q4_0", DType::q4_0, 2, 32}, {"t.q4_1", DType::q4_1, 2, 32}, {"t.q5_0", DType::q5_0, 2, 32},
      {"t.q5_1", DType::q5_1, 2, 32}, {"t.q8_0", DType::q8_0, 2, 32}, {"t.q2_k", DType::q2_k, 1, 256},
      {"t.q3_k", DType::q3_k, 1, 256}, {"t.q4_k", DType::q4_k, 1, 256}, {"t.q5_k", DType::q5_k, 1, 256},
      {"t.q6_k", DType::q6_k, 1, 256}, {"t.f16", DType::f16, 1, 4},
  };
  for (const auto& w : want) {
    const TensorInfo* q = f->find_tensor(w.name);
    ASSERT_NE(q, nullptr) << w.name;
    EXPECT_EQ(q->dtype, w.type) << w.name;
    EXPECT_EQ(q->view().rows(), w.rows) << w.name;
    EXPECT_EQ(q->view().cols(), w.cols) << w.name;
  }
}

TEST(GgufInterop, ReadsGgufPyCustomAlignment) {
  auto f = File::open(seed("align8.gguf"));
  EXPECT_EQ(f->alignment(), 8u);
  ASSERT_EQ(f->tensors().size(), 2u);
  EXPECT_EQ(f->find_tensor("b")->dtype, DType::i32);
  int32_t b[2];
  std::memcpy(b, f->find_tensor("b")->data, sizeof(b));
  EXPECT_EQ(b[1], 1);
  EXPECT_EQ(f->find_tensor("b")->offset % 8, 0u);
}

}  // namespace
}  // namespace loom::gguf
