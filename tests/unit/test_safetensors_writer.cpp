// safetensors writer: byte-identical to the Python library's save_file
// (scripts/fixtures/make_safetensors_writer_fixture.py) and round trips through the reader.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/mapped_file.h"
#include "io/safetensors.h"
#include "io/safetensors_writer.h"

namespace loom::safetensors {
namespace {

std::vector<float> closed_form(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    // volatile: keep the multiply and the subtract separately rounded, as torch
    // does (the compiler may otherwise fuse them into one FMA).
    volatile float scaled = static_cast<float>(i) * 0.1f;
    v[i] = scaled - 1.0f;
  }
  return v;
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() / ("loom_stw_" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

void add_fixture_tensors(Writer& w) {
  // Added in a different order than the reference sorts them, on purpose.
  w.add("norm.weight", closed_form(7), {7}, StDType::f16);
  w.add("layers.0.q.lora_B.weight", closed_form(15), {5, 3}, StDType::bf16);
  w.add("empty", {}, {0, 4}, StDType::bf16);
  w.add("layers.0.q.lora_A.weight", closed_form(21), {3, 7});
  w.add("a_first", closed_form(6), {2, 1, 3}, StDType::f16);
  w.add("scalar", closed_form(1), {});
  w.set_metadata("format", "pt");
}

TEST(SafetensorsWriter, ByteIdenticalToPythonLibrary) {
  const std::string ref =
      read_text_file(std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/safetensors/writer_reference.safetensors");
  Writer w("mem");
  add_fixture_tensors(w);
  const std::string got = w.serialize(WriteOrder::reference);
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_TRUE(got == ref) << "header: " << got.substr(8, 200);
}

TEST(SafetensorsWriter, RoundTripInGivenOrder) {
  TempDir dir;
  const std::string path = (dir.path / "sub" / "t.safetensors").string();
  Writer w(path);
  add_fixture_tensors(w);
  w.set_metadata("note", "héllo \"quoted\"");
  w.write();
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  auto f = File::open(path);
  ASSERT_EQ(f->tensors().size(), 6u);
  EXPECT_EQ(f->tensors()[0].name, "norm.weight");  // order as added
  EXPECT_EQ(f->tensors()[5].name, "scalar");
  EXPECT_EQ(f->metadata().at("note"), "héllo \"quoted\"");
  EXPECT_EQ(f->misaligned_count(), 0u);
  const auto* a = f->find_tensor("layers.0.q.lora_A.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape_string(), "[3, 7]");
  const auto want = closed_form(21);
  for (size_t i = 0; i < 21; ++i) {
    float v;
    std::memcpy(&v, a->data + 4 * i, 4);
    EXPECT_EQ(v, want[i]);
  }
  const auto* b = f->find_tensor("layers.0.q.lora_B.weight");
  ASSERT_NE(b, nullptr);
  for (size_t i = 0; i < 15; ++i) {
    uint16_t h;
    std::memcpy(&h, b->data + 2 * i, 2);
    EXPECT_NEAR(bf16_to_fp32(h), closed_form(15)[i], 1e-2);
  }
  EXPECT_EQ(f->find_tensor("empty")->nbytes(), 0u);
  EXPECT_EQ(f->find_tensor("scalar")->ndim, 0);
}

TEST(SafetensorsWriter, HeaderPaddedToEight) {
  for (int len = 1; len < 10; ++len) {
    Writer w("mem");
    w.add(std::string(static_cast<size_t>(len), 'x'), closed_form(3), {3});
    const std::string img = w.serialize();
    uint64_t n;
    std::memcpy(&n, img.data(), 8);
    EXPECT_EQ(n % 8, 0u);
    EXPECT_EQ(img.size(), 8 + n + 12);
  }
}

TEST(SafetensorsWriter, ErrorsNameFileAndTensor) {
  Writer w("/x/out.safetensors");
  w.add("t", closed_form(4), {2, 2});
  auto expect_error = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("/x/out.safetensors"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { w.add("t", closed_form(4), {4}); }, "duplicate");
  expect_error([&] { w.add("u", closed_form(5), {2, 2}); }, "'u'");
  expect_error([&] { w.add("__metadata__", closed_form(1), {1}); }, "__metadata__");
  expect_error([&] { w.add_raw("i", StDType::f64, {1}, std::string(8, '\0')); }, "F64");  // not a checkpoint type
  expect_error([&] { w.add("i", closed_form(1), {1}, StDType::i8); }, "I8");  // floats are not stored as integers
  expect_error([&] { w.add_raw("i", StDType::i32, {2}, std::string(4, '\0')); }, "2 elements of I32 but 4 bytes");
  expect_error([&] { w.add("n", closed_form(2), {-1, -2}); }, "negative");
  const auto dir = std::filesystem::temp_directory_path() / ("loom_stw_ro_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::create_directories(dir / "target.safetensors");  // a folder in the way of the rename
  Writer blocked((dir / "target.safetensors").string());
  blocked.add("t", closed_form(1), {1});
  EXPECT_THROW(blocked.write(), Error);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace loom::safetensors
