// safetensors reader: a file written by the reference Python library, round
// trips through the test writer, and a corruption battery where each broken
// field must give a typed error naming the file and tensor.
#include <gtest/gtest.h>

#include "expect_error.h"

#include <cmath>
#include <functional>
#include <random>

#include "core/half.h"
#include "io/safetensors.h"
#include "safetensors_test_util.h"

namespace loom {
namespace {

using namespace loom::testing_util;
using safetensors::File;
using safetensors::StDType;

const std::string kName = "mem.safetensors";

std::unique_ptr<File> parse_string(const std::string& s, const std::string& name = kName) {
  return File::parse(reinterpret_cast<const uint8_t*>(s.data()), s.size(), name);
}

// Runs `fn`, expects a loom::Error of `kind` whose message contains every needle.
using test_util::expect_error;

void expect_parse_error(const std::string& image, ErrorKind kind, std::vector<std::string> needles) {
  needles.push_back(kName);
  expect_error([&] { parse_string(image); }, kind, needles);
}

std::string header_of(const std::string& json_text) { return st_image(json_text, std::string(64, '\0')); }

// ---- a file written by the reference library --------------------------------

TEST(Safetensors, ReadsReferenceFixture) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/safetensors/tiny.safetensors";
  const auto f = File::open(path);
  EXPECT_EQ(f->path(), path);
  EXPECT_EQ(f->tensors().size(), 7u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_EQ(f->metadata().at("note"), "loom fixture");
  EXPECT_EQ(f->misaligned_count(), 0u);

  const Tensor emb = f->weight_view("model.embed_tokens.weight");
  EXPECT_EQ(emb.dtype, DType::f32);
  ASSERT_EQ(emb.ndim, 2);
  EXPECT_EQ(emb.shape[0], 3);
  EXPECT_EQ(emb.shape[1], 5);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(emb.as<float>()[i], i * 0.25f - 1) << i;

  const Tensor norm = f->weight_view("model.norm.weight");
  EXPECT_EQ(norm.dtype, DType::f16);
  for (int i = 0; i < 7; ++i) EXPECT_EQ(fp16_to_fp32(norm.as<uint16_t>()[i]), i * 0.25f - 1) << i;

  const Tensor head = f->weight_view("lm_head.weight");
  EXPECT_EQ(head.dtype, DType::bf16);
  EXPECT_EQ(head.shape_string(), "[2, 3, 4]");
  for (int i = 0; i < 24; ++i) EXPECT_EQ(bf16_to_fp32(head.as<uint16_t>()[i]), i * 0.25f - 1) << i;

  const Tensor pos = f->view("position_ids");
  EXPECT_EQ(pos.dtype, DType::i64);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(pos.as<int64_t>()[i], i - 2);

  const auto* scalar = f->find_tensor("scalar");
  ASSERT_NE(scalar, nullptr);
  EXPECT_EQ(scalar->ndim, 0);
  EXPECT_EQ(scalar->numel(), 1);
  EXPECT_EQ(scalar->view(path).as<float>()[0], 3.5f);

  const auto* empty = f->find_tensor("empty");
  ASSERT_NE(empty, nullptr);
  EXPECT_EQ(empty->numel(), 0);
  EXPECT_EQ(empty->nbytes(), 0u);

  // Known but not usable as a loom tensor / as a weight.
  const auto* mask = f->find_tensor("mask");
  ASSERT_NE(mask, nullptr);
  EXPECT_EQ(mask->st_dtype, StDType::boolean);
  EXPECT_EQ(mask->data[0], 1);
  EXPECT_EQ(mask->data[1], 0);
  expect_error([&] { f->view("mask"); }, ErrorKind::unsupported, {path, "'mask'", "BOOL"});
  expect_error([&] { f->weight_view("position_ids"); }, ErrorKind::unsupported, {path, "'position_ids'", "I64"});
  expect_error([&] { f->view("nope"); }, ErrorKind::not_found, {path, "'nope'"});
  EXPECT_EQ(f->find_tensor("nope"), nullptr);
}

// The test writer, fed the fixture's tensors, yields a file the reader sees identically.
TEST(Safetensors, WriterMatchesReferenceFixture) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/safetensors/tiny.safetensors";
  const auto ref = File::open(path);
  std::vector<StEntry> entries;
  for (const auto& t : ref->tensors()) {
    std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
    entries.push_back({t.name, safetensors::st_dtype_name(t.st_dtype), shape,
                       std::string(reinterpret_cast<const char*>(t.data), t.nbytes())});
  }
  const std::string image = st_build(entries, {{"format", "pt"}});
  const auto mine = parse_string(image);
  ASSERT_EQ(mine->tensors().size(), ref->tensors().size());
  for (const auto& t : ref->tensors()) {
    const auto* m = mine->find_tensor(t.name);
    ASSERT_NE(m, nullptr) << t.name;
    EXPECT_EQ(m->st_dtype, t.st_dtype);
    EXPECT_EQ(m->shape_string(), t.shape_string());
    EXPECT_EQ(m->begin, t.begin) << t.name;  // same order -> same layout
    ASSERT_EQ(m->nbytes(), t.nbytes());
    EXPECT_EQ(0, std::memcmp(m->data, t.data, t.nbytes())) << t.name;
  }
  // And the header sizes agree once padded the same way.
  EXPECT_EQ(mine->header_bytes() % 8, 0u);
}

// ---- round trips -----------------------------------------------------------

TEST(Safetensors, RoundTripRandomTensorsAwkwardShapes) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-3.f, 3.f);
  std::vector<StEntry> entries;
  std::vector<std::vector<float>> values;
  const std::vector<std::vector<int64_t>> shapes = {{1}, {3, 7}, {17, 1, 5}, {2, 3, 5, 7}, {13}, {1, 1, 1, 1}, {31, 9}};
  const char* dtypes[] = {"F32", "F16", "BF16"};
  for (size_t i = 0; i < shapes.size(); ++i) {
    int64_t n = 1;
    for (auto d : shapes[i]) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = dist(rng);
    const std::string dt = dtypes[i % 3];
    std::string bytes;
    if (dt == "F32") {
      bytes = raw_bytes(v);
    } else {
      std::vector<uint16_t> h;
      for (auto& x : v) {
        h.push_back(dt == "F16" ? fp32_to_fp16(x) : fp32_to_bf16(x));
        x = dt == "F16" ? fp16_to_fp32(h.back()) : bf16_to_fp32(h.back());
      }
      bytes = raw_bytes(h);
    }
    entries.push_back({"layers." + std::to_string(i) + ".w", dt, shapes[i], bytes});
    values.push_back(v);
  }
  const std::string image = st_build(entries);

  TempDir dir;
  write_file(dir.file("w.safetensors"), image);
  const auto from_disk = File::open(dir.file("w.safetensors"));
  const auto from_mem = parse_string(image);
  for (const File* f : {from_disk.get(), from_mem.get()}) {
    ASSERT_EQ(f->tensors().size(), entries.size());
    for (size_t i = 0; i < entries.size(); ++i) {
      const Tensor t = f->weight_view(entries[i].name);
      ASSERT_EQ(t.ndim, static_cast<int>(shapes[i].size()));
      for (int d = 0; d < t.ndim; ++d) EXPECT_EQ(t.shape[static_cast<size_t>(d)], shapes[i][static_cast<size_t>(d)]);
      ASSERT_EQ(t.numel(), static_cast<int64_t>(values[i].size()));
      for (int64_t k = 0; k < t.numel(); ++k) {
        float x = 0;
        if (t.dtype == DType::f32) x = t.as<float>()[k];
        else if (t.dtype == DType::f16) x = fp16_to_fp32(t.as<uint16_t>()[k]);
        else x = bf16_to_fp32(t.as<uint16_t>()[k]);
        ASSERT_EQ(x, values[i][static_cast<size_t>(k)]) << entries[i].name << " @" << k;
      }
    }
  }
}

TEST(Safetensors, UnpaddedHeaderIsReadableButNotedMisaligned) {
  // 5-byte header padding off: the F32 data starts at an odd address.
  const std::vector<float> v = {1.5f, -2.f, 3.25f};
  std::string image = st_build({{"a", "F32", {3}, raw_bytes(v)}}, nullptr, /*pad=*/false);
  // Copy into a buffer we know is 8-aligned so the file offset decides alignment.
  std::vector<uint64_t> buf((image.size() + 7) / 8);
  std::memcpy(buf.data(), image.data(), image.size());
  const auto f = File::parse(reinterpret_cast<const uint8_t*>(buf.data()), image.size(), kName);
  const auto* t = f->find_tensor("a");
  ASSERT_NE(t, nullptr);
  const bool expect_aligned = (8 + f->header_bytes()) % 4 == 0;
  EXPECT_EQ(t->aligned, expect_aligned);
  EXPECT_EQ(f->misaligned_count(), expect_aligned ? 0u : 1u);
  float got[3];
  std::memcpy(got, t->data, sizeof got);
  EXPECT_EQ(got[2], 3.25f);
}

TEST(Safetensors, EmptyTensorsMayShareOffsets) {
  const std::vector<float> v = {1.f, 2.f};
  const std::string image = st_image(
      R"({"e1":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("e2":{"dtype":"F16","shape":[4,0],"data_offsets":[8,8]},"__metadata__":null})",
      raw_bytes(v));
  const auto f = parse_string(image);
  EXPECT_EQ(f->tensors().size(), 3u);
  EXPECT_TRUE(f->metadata().empty());
}

// ---- corruption battery ----------------------------------------------------

const char* kGood = R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}})";

TEST(SafetensorsCorrupt, TooShortForLength) {
  expect_parse_error("", ErrorKind::invalid_input, {"too short"});
  expect_parse_error(std::string(7, '\0'), ErrorKind::invalid_input, {"too short"});
}

TEST(SafetensorsCorrupt, HeaderLengthPastEnd) {
  std::string image = header_of(kGood);
  image[0] = static_cast<char>(0xff);  // length now much larger than the file
  expect_parse_error(image, ErrorKind::invalid_input, {"past the end"});
}

TEST(SafetensorsCorrupt, HeaderLengthOverLimit) {
  std::string image = header_of(kGood);
  const uint64_t n = safetensors::kMaxHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) image[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  expect_parse_error(image, ErrorKind::invalid_input, {"exceeds the limit"});
  for (int i = 0; i < 8; ++i) image[static_cast<size_t>(i)] = static_cast<char>(0xff);  // 2^64 - 1
  expect_parse_error(image, ErrorKind::invalid_input, {"exceeds the limit"});
}

TEST(SafetensorsCorrupt, HeaderNotAnObject) {
  expect_parse_error(st_image("", ""), ErrorKind::invalid_input, {"JSON object"});
  expect_parse_error(header_of("[1, 2]"), ErrorKind::invalid_input, {"JSON object"});
  expect_parse_error(header_of(" {}"), ErrorKind::invalid_input, {"JSON object"});
}

TEST(SafetensorsCorrupt, BadJson) {
  expect_parse_error(header_of(R"({"a":{"dtype":"F32",)"), ErrorKind::invalid_input, {"not valid JSON", "file byte"});
  expect_parse_error(header_of(R"({"a":1} trailing)"), ErrorKind::invalid_input, {"not valid JSON"});
  expect_parse_error(header_of("{\"a\xff\":1}"), ErrorKind::invalid_input, {"not valid JSON"});  // bad UTF-8
  // A number too large for a double is a different nlohmann exception (found by fuzzing).
  expect_parse_error(header_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8E99999]}})"),
                     ErrorKind::invalid_input, {"not valid JSON"});
}

TEST(SafetensorsCorrupt, DuplicateKeys) {
  expect_parse_error(
      header_of(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})"),
      ErrorKind::invalid_input, {"'a' more than once"});
  expect_parse_error(header_of(R"({"a":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})"),
                     ErrorKind::invalid_input, {"'dtype' more than once"});
}

TEST(SafetensorsCorrupt, BadEntries) {
  expect_parse_error(header_of(R"({"w":5})"), ErrorKind::invalid_input, {"'w'", "must be an object"});
  expect_parse_error(header_of(R"({"w":{"shape":[1],"data_offsets":[0,4]}})"), ErrorKind::invalid_input,
                     {"'w'", "'dtype'"});
  expect_parse_error(header_of(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,4]}})"), ErrorKind::invalid_input,
                     {"'w'", "'dtype'"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})"), ErrorKind::unsupported,
                     {"'w'", "unknown dtype 'F4'"});
  expect_parse_error(header_of(R"({"w":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})"), ErrorKind::unsupported,
                     {"'w'", "'f32'"});  // names are case-sensitive in the format
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":3,"data_offsets":[0,12]}})"), ErrorKind::invalid_input,
                     {"'w'", "'shape'"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","data_offsets":[0,12]}})"), ErrorKind::invalid_input,
                     {"'w'", "'shape'"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[-3],"data_offsets":[0,12]}})"),
                     ErrorKind::invalid_input, {"'w'", "negative"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,10]}})"),
                     ErrorKind::invalid_input, {"'w'", "integers"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":["3"],"data_offsets":[0,12]}})"),
                     ErrorKind::invalid_input, {"'w'", "integers"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[1,1,1,1,1],"data_offsets":[0,4]}})"),
                     ErrorKind::unsupported, {"'w'", "5 dimensions"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})"), ErrorKind::invalid_input,
                     {"'w'", "data_offsets"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":{"b":0}}})"),
                     ErrorKind::invalid_input, {"'w'", "data_offsets"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})"),
                     ErrorKind::invalid_input, {"'w'", "negative"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})"), ErrorKind::invalid_input,
                     {"'w'", "end before begin"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})"),
                     ErrorKind::invalid_input, {"'w'", "too large"});
}

TEST(SafetensorsCorrupt, BadMetadata) {
  expect_parse_error(header_of(R"({"__metadata__":{"format":3}})"), ErrorKind::invalid_input,
                     {"__metadata__", "'format'", "string"});
  expect_parse_error(header_of(R"({"__metadata__":["pt"]})"), ErrorKind::invalid_input, {"__metadata__"});
}

TEST(SafetensorsCorrupt, SizeMismatch) {
  // [2,3] F32 needs 24 bytes, offsets span 20.
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})"),
                     ErrorKind::invalid_input, {"'w'", "needs 24 bytes", "span 20"});
  expect_parse_error(header_of(R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,24]}})"),
                     ErrorKind::invalid_input, {"'w'", "needs 12 bytes"});
}

TEST(SafetensorsCorrupt, ShapeOverflow) {
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,16]}})"),
                     ErrorKind::invalid_input, {"'w'", "overflows"});
  expect_parse_error(
      header_of(R"({"w":{"dtype":"F64","shape":[9223372036854775807,2],"data_offsets":[0,16]}})"),
      ErrorKind::invalid_input, {"'w'", "overflows"});
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,16]}})"),
                     ErrorKind::invalid_input, {"'w'", "too large"});
}

TEST(SafetensorsCorrupt, OutOfRangeOffsets) {
  // Header claims 64 bytes of data; the file has exactly 64.
  expect_parse_error(header_of(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[56,72]}})"),
                     ErrorKind::invalid_input, {"'w'", "past the data section"});
  EXPECT_NO_THROW(parse_string(header_of(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[48,64]}})")));
}

TEST(SafetensorsCorrupt, Overlap) {
  expect_parse_error(header_of(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                               R"("b":{"dtype":"F32","shape":[4],"data_offsets":[12,28]}})"),
                     ErrorKind::invalid_input, {"'a'", "'b'", "overlap"});
  // Identical ranges overlap too.
  expect_parse_error(header_of(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                               R"("b":{"dtype":"I32","shape":[4],"data_offsets":[0,16]}})"),
                     ErrorKind::invalid_input, {"overlap"});
  // Adjacent is fine.
  EXPECT_NO_THROW(parse_string(header_of(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                                         R"("b":{"dtype":"F32","shape":[4],"data_offsets":[16,32]}})")));
}

TEST(SafetensorsCorrupt, TruncatedFileNamesFileAndTensor) {
  const std::vector<float> v(10, 1.f);
  const std::string image = st_build({{"t.weight", "F32", {2, 5}, raw_bytes(v)}});
  TempDir dir;
  const std::string path = dir.file("cut.safetensors");
  write_file(path, image.substr(0, image.size() - 3));
  expect_error([&] { File::open(path); }, ErrorKind::invalid_input, {path, "'t.weight'", "truncated"});
  expect_error([&] { File::open(dir.file("missing.safetensors")); }, ErrorKind::not_found, {"missing.safetensors"});
}

// Every prefix of a valid file must be rejected cleanly (never crash, never accept).
TEST(SafetensorsCorrupt, EveryTruncationRejected) {
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  const std::vector<uint16_t> h = {1, 2, 3};
  const std::string image =
      st_build({{"a", "F32", {2, 3}, raw_bytes(v)}, {"b", "BF16", {3}, raw_bytes(h)}}, {{"format", "pt"}});
  ASSERT_NO_THROW(parse_string(image));
  for (size_t n = 0; n < image.size(); ++n) {
    const std::string cut = image.substr(0, n);
    EXPECT_THROW(parse_string(cut), Error) << "prefix " << n;
  }
}

// Random byte flips: either a clean Error or a file whose views all lie in bounds.
TEST(SafetensorsCorrupt, RandomMutationsNeverEscapeBounds) {
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  const std::vector<uint16_t> h = {1, 2, 3, 4, 5};
  const std::string image = st_build({{"a", "F32", {2, 3}, raw_bytes(v)}, {"b", "F16", {5}, raw_bytes(h)}});
  std::mt19937 rng(12345);
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string m = image;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) {
      const size_t pos = rng() % m.size();
      m[pos] = static_cast<char>(rng() % 3 == 0 ? "0123456789[]{},\":-"[rng() % 18] : static_cast<char>(rng()));
    }
    try {
      const auto f = parse_string(m);
      ++accepted;
      const auto* lo = reinterpret_cast<const uint8_t*>(m.data());
      for (const auto& t : f->tensors()) {
        ASSERT_GE(t.data, lo + 8 + f->header_bytes());
        ASSERT_LE(t.data + t.nbytes(), lo + m.size());
      }
    } catch (const Error&) {
    }
  }
  EXPECT_GT(accepted, 0);  // flips inside the data section keep the file valid
}

}  // namespace
}  // namespace loom
