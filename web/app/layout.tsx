import type { Metadata, Viewport } from "next";
import "./globals.css";
import "./highlight.css";

export const metadata: Metadata = {
  title: "Hearth",
  description: "Chat with the model Hearth serves",
};

export const viewport: Viewport = {
  width: "device-width",
  initialScale: 1,
  colorScheme: "light dark",
};

// Applies a remembered theme before the first paint (no flash); otherwise CSS follows the system.
const THEME_SCRIPT = `try{var t=localStorage.getItem("hearth.theme");if(t==="light"||t==="dark")document.documentElement.dataset.theme=t}catch(e){}`;

export default function RootLayout({ children }: { children: React.ReactNode }) {
  return (
    <html lang="en" suppressHydrationWarning>
      <head>
        <script dangerouslySetInnerHTML={{ __html: THEME_SCRIPT }} />
      </head>
      <body>{children}</body>
    </html>
  );
}
